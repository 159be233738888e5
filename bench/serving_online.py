"""The online half of bench_serving.py: a `core serve` subprocess and a load generator for it.

`ServerProcess` starts `python -m core.cli serve` on a free local port with a random API key,
waits for /health, and stops it with SIGTERM (then SIGKILL to its process group) even when the
benchmark fails. `run_load` sends requests at a Poisson rate (inf: all at once) under a
concurrency cap, streaming (SSE) through /v1/completions with token-id prompts, and measures what
SGLang's bench_serving measures: per request TTFT, inter-token latencies (gaps between streamed
chunks), end-to-end latency, and the token counts the server's usage reports;
`summarize_online` turns those into throughputs and mean / median / p99. After the load,
`engine_stats` reads the scheduler's figures that explain a run (`/get_server_info`): the prefill
budget's cap, capped extends and measurements, forwards per kind, retractions.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0..100), linear between closest ranks (numpy's default)."""
    if not values:
        return None
    s = sorted(values)
    k = (len(s) - 1) * q / 100
    lo = math.floor(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def latency_stats(name: str, seconds: list[float]) -> dict[str, float | None]:
    """{name}_mean_ms, _median_ms, _p99_ms of a list of durations in seconds."""
    ms = [v * 1e3 for v in seconds]
    return {f"{name}_mean_ms": sum(ms) / len(ms) if ms else None,
            f"{name}_median_ms": percentile(ms, 50), f"{name}_p99_ms": percentile(ms, 99)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`core serve` in a subprocess (its own session, output to a log file); a context manager."""

    def __init__(self, flags: list[str], log_path: str | os.PathLike, startup_timeout: float):
        self.flags = flags
        self.log_path = Path(log_path)
        self.startup_timeout = startup_timeout
        self.host, self.port = "127.0.0.1", free_port()
        self.api_key = secrets.token_hex(16)
        self.proc: subprocess.Popen | None = None
        self.startup_s: float | None = None
        self.exit_code: int | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def log_tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no server log)"

    def __enter__(self) -> ServerProcess:
        env = dict(os.environ)
        # serve this checkout, whatever `core` may be installed elsewhere
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
        cmd = [sys.executable, "-m", "core.cli", "serve", "--host", self.host,
               "--port", str(self.port), "--api-key", self.api_key, *self.flags]
        t0 = time.perf_counter()
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                         start_new_session=True)
        try:
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.perf_counter() - t0
        return self

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"core serve exited with code {self.proc.returncode} during "
                                   f"start-up; log tail:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass  # not listening yet, or 503 while the engine starts
            time.sleep(0.5)
        raise RuntimeError(f"core serve was not healthy within {self.startup_timeout:.0f} s; "
                           f"log tail:\n{self.log_tail()}")

    def stop(self, timeout: float = 60.0) -> None:
        """SIGTERM (the server drains, then stops its engine); SIGKILL the group if it hangs."""
        p = self.proc
        if p is None or p.poll() is not None:
            self.exit_code = None if p is None else p.returncode
            return
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(timeout)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(p.pid, signal.SIGKILL)  # its own session: the server and its worker
            except ProcessLookupError:
                pass
            p.wait(10)
        self.exit_code = p.returncode

    def __exit__(self, *exc: Any) -> None:
        self.stop()


@dataclass
class RequestResult:
    prompt_len: int
    ok: bool = False
    error: str | None = None
    ttft: float | None = None  # seconds from sending to the first streamed token
    e2e: float = 0.0  # seconds from sending to the end of the stream
    itl: list[float] = field(default_factory=list)  # gaps between streamed chunks
    chunks: int = 0  # chunks that carried text
    output_tokens: int = 0  # the server's usage.completion_tokens
    cached_tokens: int | None = None  # usage.prompt_tokens_details, when the server reports it


async def _one(session: Any, url: str, headers: dict[str, str], body: bytes, prompt_len: int,
               sem: asyncio.Semaphore | None) -> RequestResult:
    import aiohttp

    r = RequestResult(prompt_len)
    if sem is not None:
        await sem.acquire()
    try:
        t0 = time.perf_counter()
        last = t0
        done = False
        try:
            async with session.post(url, data=body, headers=headers) as resp:
                if resp.status != 200:
                    r.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                    return r
                async for raw in resp.content:  # one SSE line at a time
                    line = raw.strip()
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        done = True
                        break
                    obj = json.loads(data)
                    if "error" in obj:
                        r.error = str(obj["error"].get("message", obj["error"]))[:200]
                        break
                    if obj.get("usage"):
                        r.output_tokens = int(obj["usage"].get("completion_tokens") or 0)
                        details = obj["usage"].get("prompt_tokens_details") or {}
                        r.cached_tokens = details.get("cached_tokens")
                    for ch in obj.get("choices") or ():
                        if ch.get("text"):
                            now = time.perf_counter()
                            if r.ttft is None:
                                r.ttft = now - t0
                            else:
                                r.itl.append(now - last)
                            last = now
                            r.chunks += 1
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
            r.error = f"{type(exc).__name__}: {exc}"[:200]
        r.e2e = time.perf_counter() - t0
        if r.error is None and not done:
            r.error = "the stream ended without [DONE]"
        if r.error is None and r.ttft is None:
            r.error = "no token was streamed"
        r.ok = r.error is None
        return r
    finally:
        if sem is not None:
            sem.release()


async def run_load(base_url: str, api_key: str | None, prompts: list[list[int]], output_len: int,
                   request_rate: float, max_concurrency: int | None, seed: int = 0
                   ) -> tuple[list[RequestResult], float]:
    """Send every prompt (Poisson arrivals at request_rate/s; inf = at once); (results, seconds)."""
    import aiohttp

    url = base_url + "/v1/completions"
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    # bodies are serialized before the clock starts: the client's JSON work is not measured
    bodies = [json.dumps({"prompt": p, "max_tokens": output_len, "temperature": 0.0,
                          "ignore_eos": True, "stream": True,
                          "stream_options": {"include_usage": True}}).encode() for p in prompts]
    rng = random.Random(seed)
    arrivals, t = [], 0.0
    for _ in prompts:  # absolute arrival times, so sleeping late does not drift the rate
        arrivals.append(t)
        if math.isfinite(request_rate):
            t += rng.expovariate(request_rate)
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    connector = aiohttp.TCPConnector(limit=max_concurrency or 0)
    # headers come with the first token, so a queued request is silent for a while; not forever
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=60, sock_read=600)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        tasks = []
        start = time.perf_counter()
        for body, p, at in zip(bodies, prompts, arrivals, strict=True):
            delay = start + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(_one(session, url, headers, body, len(p), sem)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    return list(results), duration


ENGINE_STATS = ("prefill_budget_target_ms", "prefill_budget_tokens", "prefill_capped_steps",
                "prefill_budget_extend_tok_s", "prefill_budget_decode_ms", "retractions",
                "steps", "prefill_tokens", "decode_tokens", "forward_count")


def engine_stats(base_url: str, api_key: str | None) -> dict[str, Any]:
    """The scheduler's figures of ENGINE_STATS from /get_server_info ({"error": ...} if it
    cannot be read: the load's results stand without them)."""
    req = urllib.request.Request(base_url + "/get_server_info",
                                 headers={"Authorization": f"Bearer {api_key}"} if api_key
                                 else {})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            stats = json.loads(resp.read())["stats"]
    except (OSError, ValueError, KeyError) as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    eng = stats.get("engine") or stats
    return {k: eng[k] for k in ENGINE_STATS if k in eng}


def summarize_online(results: list[RequestResult], duration: float, per_request: bool = False
                     ) -> dict[str, Any]:
    """SGLang bench_serving's metrics over the completed requests."""
    ok = [r for r in results if r.ok]
    errors = sorted({r.error for r in results if not r.ok and r.error})
    tin = sum(r.prompt_len for r in ok)
    tout = sum(r.output_tokens for r in ok)
    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    out: dict[str, Any] = {
        "completed": len(ok), "failed": len(results) - len(ok), "errors": errors[:5],
        "duration_s": duration, "total_input_tokens": tin, "total_output_tokens": tout,
        "request_throughput": len(ok) / duration, "input_tok_s": tin / duration,
        "output_tok_s": tout / duration, "total_tok_s": (tin + tout) / duration,
        # average number of requests in flight, as SGLang reports it
        "concurrency": sum(r.e2e for r in ok) / duration,
        **latency_stats("ttft", [r.ttft for r in ok]),
        **latency_stats("tpot", tpot),
        **latency_stats("itl", [g for r in ok for g in r.itl]),
        **latency_stats("e2e", [r.e2e for r in ok])}
    if per_request:
        out["per_request"] = [
            {"ok": r.ok, "prompt_tokens": r.prompt_len, "output_tokens": r.output_tokens,
             "chunks": r.chunks, "ttft_ms": None if r.ttft is None else r.ttft * 1e3,
             "e2e_ms": r.e2e * 1e3, "cached_tokens": r.cached_tokens, "error": r.error}
            for r in results]
    return out


def bench_online(model_flags: list[str], prompts: list[list[int]], output_len: int,
                 request_rate: float, max_concurrency: int | None,
                 warmup_prompts: list[list[int]], log: Path, startup_timeout: float,
                 per_request: bool = False) -> dict[str, Any]:
    """Start the server, warm it up (prompts other than the measured ones: no cache hits),
    run the load, stop it; the summary."""
    res: dict[str, Any] = {"num_prompts": len(prompts), "request_rate": request_rate,
                           "max_concurrency": max_concurrency, "output_len": output_len,
                           "input_len": len(prompts[0]) if prompts else 0,
                           "server_log": str(log)}
    srv = ServerProcess(model_flags, log, startup_timeout)
    with srv:
        res["server_startup_s"] = srv.startup_s
        if warmup_prompts:  # compiles / autotunes this prompt length; must succeed
            warm, _ = asyncio.run(run_load(srv.url, srv.api_key, warmup_prompts,
                                           min(output_len, 8), math.inf, None, seed=1))
            bad = [r.error for r in warm if not r.ok]
            if bad:
                raise RuntimeError(f"online warm-up failed: {bad[0]}; server log tail:\n"
                                   f"{srv.log_tail()}")
        results, duration = asyncio.run(run_load(srv.url, srv.api_key, prompts, output_len,
                                                 request_rate, max_concurrency))
        res["engine_stats"] = engine_stats(srv.url, srv.api_key)
    res.update(summarize_online(results, duration, per_request))
    res["server_exit_code"] = srv.exit_code
    return res
