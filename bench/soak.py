"""Long soak of `core serve` on the real engine: mixed traffic for --duration seconds, the RSS of
the HTTP process and of the engine worker sampled every second, then the slope of each (least
squares over the samples after --warmup seconds, and over the last half alone), error counts,
and a KV leak check. The worker's KV pool is allocated zeroed: its pages join the RSS as they are
first written, so the worker grows until the pool has been touched once (kv_pool_mb bounds it).

    python bench/soak.py --duration 300              # starts its own `core serve` (SmolLM2)
    python bench/soak.py --url http://host:30000 --key-file KEY --duration 600

Traffic (conformance.server_kit.soak_traffic): non-streaming completions, chat streams read to the
end, streams cut after their first event, /generate with n=2, malformed requests (must be 4xx),
health / readiness / metrics probes. The server started here has a small admission limit, so
some requests are turned away with 503 + Retry-After; those are counted as "overloaded", not as
errors. Prints a JSON report (and writes it with --out).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from machine_info import cpu_model

from conformance.server_kit import http_request, soak_traffic


def _rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def _children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(x) for x in (task / "children").read_text().split()]
        except OSError:
            pass
    return out


def slope_mb_per_min(samples: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of (seconds, MB) samples, in MB per minute."""
    if len(samples) < 3:
        return None
    n = len(samples)
    mt = sum(t for t, _ in samples) / n
    mv = sum(v for _, v in samples) / n
    var = sum((t - mt) ** 2 for t, _ in samples)
    if var == 0:
        return None
    return 60 * sum((t - mt) * (v - mv) for t, v in samples) / var


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _metric(url: str, name: str) -> float | None:
    raw = http_request(url, "GET", "/metrics", None, {}, timeout=60)[2].decode()
    for line in raw.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration", type=float, default=300.0, help="seconds of traffic")
    ap.add_argument("--warmup", type=float, default=30.0,
                    help="seconds of samples left out of the slope (allocator warm-up)")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--url", help="soak a running server instead of starting one")
    ap.add_argument("--key-file", help="API key of --url's server")
    ap.add_argument("--serve-args", default="--max-total-tokens 8192 --max-running-requests 8 "
                    "--max-queued-requests 8", help="flags for the `core serve` started here")
    ap.add_argument("--out", help="write the JSON report here too")
    ns = ap.parse_args(argv)

    proc = None
    key = Path(ns.key_file).read_text().strip() if ns.key_file else None
    url = ns.url
    tmp = tempfile.TemporaryDirectory()
    try:
        if url is None:
            key = "sk-soak-" + os.urandom(8).hex()
            keyfile = Path(tmp.name) / "key"
            keyfile.write_text(key + "\n")
            port = _free_port()
            cmd = [sys.executable, "-m", "core.cli", "serve", "--port", str(port),
                   "--api-key-file", str(keyfile), *ns.serve_args.split()]
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
            t0 = time.monotonic()
            while time.monotonic() - t0 < 600:
                line = proc.stdout.readline()
                if not line:
                    raise SystemExit("core serve exited during start-up")
                if "listening on" in line:
                    break
            url = f"http://127.0.0.1:{port}"
            server_pid = proc.pid
            worker_pids = _children(proc.pid)
        else:
            server_pid, worker_pids = None, []
        rss: dict[str, list[tuple[float, float]]] = {"server": [], "worker": []}
        start = time.monotonic()

        def sample() -> None:
            t = time.monotonic() - start
            if server_pid is not None and (v := _rss_mb(server_pid)) is not None:
                rss["server"].append((t, v))
            vals = [v for p in worker_pids if (v := _rss_mb(p)) is not None]
            if vals:
                rss["worker"].append((t, sum(vals)))

        sample()
        counts = asyncio.run(soak_traffic(url, key, ns.duration, ns.concurrency,
                                          ns.max_tokens, on_tick=sample))
        sample()
        time.sleep(2.0)  # let cut streams' aborts land before the leak check
        kv_used = _metric(url, "core_kv_pages_used")
        info = None
        try:  # the KV pool is allocated zeroed, so its pages join the RSS as they are first used
            si = json.loads(http_request(url, "GET", "/get_server_info", None,
                                         {"Authorization": f"Bearer {key}"} if key else {},
                                         timeout=60)[2])
            m = si.get("model") or {}
            eng = (si.get("stats") or {}).get("engine") or {}
            per_token = m.get("kv_bytes_per_token") or eng.get("kv_bytes_per_token")
            if per_token and m.get("kv_pool_tokens"):
                info = round(per_token * m["kv_pool_tokens"] / 2**20, 1)
        except (OSError, ValueError):
            pass
        running = _metric(url, "core_num_running_reqs")
        report = {
            "command": "python bench/soak.py " + " ".join(argv if argv is not None
                                                          else sys.argv[1:]),
            "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
            "machine": cpu_model(), "cpus": os.cpu_count(), "python": platform.python_version(),
            "duration_s": ns.duration, "concurrency": ns.concurrency,
            "requests": counts["requests"], "ok": counts["ok"],
            "client_error_expected": counts["client_error"], "overloaded_503": counts["overloaded"],
            "server_error": counts["server_error"], "transport_error": counts["transport"],
            "unexpected": counts["unexpected"], "by_kind": counts["by_kind"],
            "examples": counts["examples"],
            "kv_pages_used_after": kv_used, "running_after": running,
        }
        for name, samples in rss.items():
            if not samples:
                continue
            kept = [s for s in samples if s[0] >= ns.warmup] or samples
            report[f"rss_{name}_mb_start"] = round(samples[0][1], 1)
            report[f"rss_{name}_mb_end"] = round(samples[-1][1], 1)
            report[f"rss_{name}_mb_max"] = round(max(v for _, v in samples), 1)
            s = slope_mb_per_min(kept)
            report[f"rss_{name}_slope_mb_per_min"] = None if s is None else round(s, 3)
            # a leak keeps its slope; first touches of preallocated memory flatten out
            late = [x for x in kept if x[0] >= (kept[0][0] + kept[-1][0]) / 2]
            s = slope_mb_per_min(late)
            report[f"rss_{name}_slope_last_half_mb_per_min"] = None if s is None else round(s, 3)
        if info:
            report["kv_pool_mb"] = info
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            try:
                rc = proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                proc.kill()
                rc = proc.wait(10)
        tmp.cleanup()
    if proc is not None:
        report["server_exit_code"] = rc
    text = json.dumps(report, indent=2)
    print(text)
    if ns.out:
        Path(ns.out).write_text(text + "\n")
    bad = report["server_error"] + report["transport_error"] + report["unexpected"]
    return 1 if bad or (kv_used or 0) > 0 else 0


if __name__ == "__main__":
    sys.exit(main())
