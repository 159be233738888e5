"""The server's test kit: a deterministic in-process engine (no model, no torch), a server thread,
raw HTTP helpers and soak traffic, for testing the HTTP layer without a model (moved from
core.server.testing: it is not the serving core).

FakeEngine speaks `EngineLike`. Its tokenizer is byte-level (id = byte + 3; 0 pad, 1 bos, 2 eos).
Its greedy "model" answers with the bytes of `reply` (default "hello world "), repeated, one
token per step, so outputs are predictable. Knobs for fault tests:
  - token_delay: seconds between tokens (asyncio.sleep: the loop stays free);
  - a prompt containing "FAIL_EVENT" ends with an error delta after its first token,
    "FAIL_RAISE" raises inside the engine after its first token, "MALFORMED" sends a
    logprob whose top alternative is no token of the vocabulary with its second token;
  - max_active: more concurrent requests than this are rejected as "queue full" (503);
  - alive / wedged: what health() says (wedged: it never answers);
  - failed: set to a reason to play a dead engine process (failure() returns it);
  - a rid already in flight is refused with 400, as the real engine client refuses it;
  - tool_call_parser: the plan's tool-call parser (None: auto tool calls off); its template
    reads no `tools`, so they reach the prompt as the parser's system message.
  - reasoning_parser: the plan's reasoning parser (None: off); give a `reply` that writes the
    parser's markup (`<think>...</think>answer`). Its template takes chat_template_kwargs as
    Qwen3's does: `enable_thinking: false` closes an empty think block in the prompt.
It keeps KV accounting like the real pool: pages_in_use() counts pages of live requests only, so
a test can check that aborted and finished requests give their pages back.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncGenerator, Sequence
from typing import Any

from core.contract.json_types import JSON
from core.frontend.delta import Delta
from core.frontend.serving import GenRequest
from core.messages import Finish, TokenLogprob
from core.server.errors import invalid, overloaded

PAD, BOS, EOS = 0, 1, 2
OFFSET = 3


class FakeTokenizer:
    vocab_size = 256 + OFFSET
    special_tokens = ("<|eos|>",)  # spelt in chat content it is refused, as a real one would be

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [b + OFFSET for b in text.encode("utf-8")]

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(i - OFFSET for i in ids if i >= OFFSET).decode("utf-8", "replace")

    def token_bytes(self, token_id: int) -> bytes:
        return bytes([token_id - OFFSET]) if token_id >= OFFSET else b""

    chat_template = None  # not Jinja: it never reads `tools` (they come as a system message)

    def apply_chat_template(self, messages: list[dict[str, Any]], *,
                            add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None,
                            **template_vars: JSON) -> str:
        for i, m in enumerate(messages):
            if m["role"] == "system" and i:
                raise ValueError("a system message may only come first")
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages)
        if not add_generation_prompt:
            return text
        # Qwen3's way: thinking off closes an empty think block in the prompt
        off = template_vars.get("enable_thinking") is False
        return text + "<assistant>" + ("<think>\n\n</think>\n\n" if off else "")


class FakeEngine:
    """See the module docstring."""

    page_size = 4
    total_pages = 4096

    def __init__(self, context_length: int = 256, reply: str = "hello world ",
                 token_delay: float = 0.0, max_active: int | None = None,
                 tool_call_parser: str | None = None, reasoning_parser: str | None = None):
        self.tokenizer = FakeTokenizer()
        self.vocab_size = self.tokenizer.vocab_size
        self.model_name = "fake-model"
        self.context_length = context_length
        self.reply = reply
        self.token_delay = token_delay
        self.max_active = max_active
        self.tool_call_parser = tool_call_parser  # the plan's (None: auto tool calls off)
        self.reasoning_parser = reasoning_parser  # the plan's (None: off)
        self.alive = True
        self.wedged = False
        self.failed: str | None = None
        self.active: dict[str, int] = {}  # rid -> tokens held in KV
        self.aborted: set[str] = set()
        self.submitted: list[GenRequest] = []
        self.finished = 0
        self._seen: list[tuple[int, ...]] = []  # prompts served, for "cached" prefix tokens
        self.shut_down = False

    # -- EngineLike -----------------------------------------------------------------------------
    def plan_dict(self) -> dict[str, Any]:
        return {"device": {"name": "fake"}, "prefill_attention": "fake", "decode_attention":
                "fake", "page_size": self.page_size,
                "tool_call_parser": self.tool_call_parser,
                "reasoning_parser": self.reasoning_parser,
                "candidates": [{"slot": "decode_attention", "name": "fake", "fits": True,
                                "chosen": True, "reasons": []}]}

    def describe_plan(self) -> str:
        return "Plan:\n  decode attention   fake"

    def model_info(self) -> dict[str, Any]:
        return {"model_path": "fake://model", "tokenizer_path": "fake://model",
                "architecture": "FakeForCausalLM"}

    def validate_sampling(self, sampling: dict[str, Any]) -> None:
        # a couple of the real engine's rules, so the server's ValueError path is exercised
        if sampling.get("top_k") == 0:
            raise ValueError("top_k must be -1 (off) or a positive integer, got 0")
        if sampling.get("repetition_penalty", 1.0) <= 0:
            raise ValueError("repetition_penalty must be in (0, 2]")
        if sampling.get("logit_bias"):  # it could not apply one: refused, never ignored
            raise ValueError("logit_bias: the fake engine does not sample from logits")
        if sampling.get("constraint"):  # it could not enforce one: refused, never ignored
            raise ValueError(f"{sampling['constraint']['source']}: structured output is off "
                             "in this engine (the fake engine has no grammar backend)")

    def pages_in_use(self) -> int:
        return sum(math.ceil(n / self.page_size) for n in self.active.values())

    def _cached(self, ids: tuple[int, ...]) -> int:
        best = 0
        for seen in self._seen:
            n = 0
            for a, b in zip(seen, ids, strict=False):
                if a != b:
                    break
                n += 1
            best = max(best, n)
        return min(best, len(ids) - 1) // self.page_size * self.page_size

    async def generate(self, req: GenRequest) -> AsyncGenerator[Delta, None]:
        if not self.alive:
            raise RuntimeError("the engine process is gone")
        if self.max_active is not None and len(self.active) >= self.max_active:
            raise overloaded()
        if req.rid in self.active:
            raise invalid(None, f"request id {req.rid!r} is already in use")
        self.submitted.append(req)
        rid, prompt = req.rid, req.input_ids
        text = self.tokenizer.decode(prompt)
        cached = self._cached(prompt)
        self._seen.append(prompt)
        self.active[rid] = len(prompt)
        max_new = req.sampling["max_new_tokens"]
        reply = self.reply.encode()
        tokens = [reply[i % len(reply)] + OFFSET for i in range(max_new)]
        full = self.tokenizer.decode(tokens)
        # like the engine: stop at the first stop string, which is not part of the output
        hits = [(full.find(s), s) for s in req.sampling.get("stop") or [] if s in full]
        cut, matched = min(hits) if hits else (len(full), None)
        last = cut + len(matched) - 1 if matched else max_new - 1  # step that finishes
        try:
            for step in range(last + 1):
                await asyncio.sleep(self.token_delay)
                if rid in self.aborted:
                    return
                if step == 1 and "FAIL_RAISE" in text:
                    raise RuntimeError("simulated kernel failure")
                tid = tokens[step]
                self.active[rid] += 1
                lps = None
                if req.logprobs:
                    alts = ((tid, -0.25), (EOS, -1.5), (OFFSET + 33, -2.5))[:req.top_logprobs]
                    lps = (TokenLogprob(-0.25, alts),)
                    if step == 1 and "MALFORMED" in text:  # a broken delta: the server copes
                        lps = (TokenLogprob(-0.25, ((10**9, -1.0),)),)
                k = req.sampling.get("prompt_logprobs")
                plps = None
                if step == 0 and k is not None:  # like the engine: with the first token
                    plps = tuple(TokenLogprob(-1.0, ((t, -1.0), (EOS, -3.0),
                                                     (OFFSET + 33, -4.0))[:k])
                                 for t in prompt[1:])
                piece = full[step:step + 1] if step < cut else ""
                if step == 1 and "FAIL_EVENT" in text:
                    yield Delta(rid, 0, piece, (tid,), Finish("abort"), logprobs=lps,
                                prompt_logprobs=plps, error="simulated failure in the engine")
                    return
                finish = None
                if step == last:
                    finish = Finish("stop", matched=matched) if matched else Finish("length")
                    self.finished += 1
                yield Delta(rid, 0, piece, (tid,), finish, len(prompt), step + 1,
                            cached if finish is not None else 0, lps, plps)
        finally:
            self.active.pop(rid, None)

    def abort(self, rid: str) -> None:
        if rid in self.active:
            self.aborted.add(rid)
            self.active.pop(rid, None)

    async def health(self) -> bool:
        if self.wedged:
            await asyncio.sleep(3600)
        return self.alive and self.failed is None

    def failure(self) -> str | None:
        return self.failed

    async def stats(self) -> dict[str, Any]:
        return {"num_running_reqs": len(self.active), "num_queued_reqs": 0,
                "kv_pages_used": self.pages_in_use(), "kv_pages_total": self.total_pages,
                "prefix_cache_hit_rate": 0.5}

    async def shutdown(self) -> None:
        self.shut_down = True


class ServerThread:
    """Run an app on 127.0.0.1 (a free port) in a background thread with its own event loop.

    As a context manager: `with ServerThread(app) as srv: ... srv.url ...`. `srv.call(fn)` runs
    fn() on the server's loop and returns its result (to read engine state without races).
    Handlers are cancelled when their client disconnects, as under `core serve`.
    """

    def __init__(self, app: Any, host: str = "127.0.0.1", **runner_kw: Any):
        import threading

        self.app, self.host = app, host
        self.runner_kw = runner_kw  # for core.server.serve.make_runner (header_timeout, ...)
        self.port = 0
        self.loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="core-test-server", daemon=True)
        self._error: BaseException | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def _run(self) -> None:
        from aiohttp import web

        asyncio.set_event_loop(self.loop)

        from core.server.serve import make_runner

        async def start() -> web.AppRunner:
            runner = make_runner(self.app, **{"shutdown_timeout": 1.0, **self.runner_kw})
            await runner.setup()
            site = web.TCPSite(runner, self.host, 0)
            await site.start()
            self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
            return runner

        try:
            self.runner = self.loop.run_until_complete(start())
        except BaseException as e:  # surfaced by __enter__
            self._error = e
            self._ready.set()
            return
        self._ready.set()
        self.loop.run_forever()
        self.loop.run_until_complete(self.runner.cleanup())
        self.loop.close()

    def call(self, fn: Any, timeout: float = 10.0) -> Any:
        import concurrent.futures

        async def run() -> Any:
            r = fn()
            return await r if asyncio.iscoroutine(r) else r

        fut: concurrent.futures.Future = asyncio.run_coroutine_threadsafe(run(), self.loop)
        return fut.result(timeout)

    def __enter__(self) -> ServerThread:
        self._thread.start()
        self._ready.wait(30)
        if self._error is not None:
            raise self._error
        return self

    def __exit__(self, *exc: Any) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(15)


def http_request(url: str, method: str, path: str, body: Any = None,
                 headers: dict[str, Any] | None = None, timeout: float = 30.0
                 ) -> tuple[int, dict[str, str], bytes]:
    """One blocking HTTP request with full control of the bytes sent (http.client).

    body: bytes as is, str as UTF-8, anything else as JSON. Header values may be bytes (sent raw).
    Returns (status, headers with lower-case names, body bytes).
    """
    import http.client
    import json
    from urllib.parse import urlsplit

    u = urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
    try:
        if body is not None and not isinstance(body, (bytes, str)):
            body = json.dumps(body)
        if isinstance(body, str):
            body = body.encode("utf-8")
        conn.putrequest(method, path)
        hdrs = dict(headers or {})
        if body is not None and "Transfer-Encoding" not in hdrs:
            hdrs.setdefault("Content-Length", str(len(body)))
        hdrs.setdefault("Content-Type", "application/json")
        for k, v in hdrs.items():
            conn.putheader(k, v)
        conn.endheaders()
        try:
            if body is not None and hdrs.get("Transfer-Encoding") == "chunked":
                step = 1 << 16
                for i in range(0, len(body), step):
                    part = body[i:i + step]
                    conn.send(f"{len(part):x}\r\n".encode() + part + b"\r\n")
                conn.send(b"0\r\n\r\n")
            elif body is not None:
                conn.send(body)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server answered early (413, 401) and closed; read that answer
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


def send_stream_request(port: int, body: Any, key: str | None = None,
                        path: str = "/v1/completions", timeout: float = 10.0) -> Any:
    """POST `body` (JSON) on a raw socket to 127.0.0.1:port and return the socket unread, so a
    test can read a little of a stream and then cut it (`read_first_chunk`, then close)."""
    import json
    import socket

    sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    payload = json.dumps(body).encode()
    auth = f"Authorization: Bearer {key}\r\n" if key else ""
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\n{auth}"
                 f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n"
                 .encode() + payload)
    return sock


def read_first_chunk(sock: Any) -> bytes:
    """Read a streaming response until its first SSE data line; assert it is a 200."""
    buf = b""
    while b"data: " not in buf:
        part = sock.recv(65536)
        assert part, buf
        buf += part
    assert buf.startswith(b"HTTP/1.1 200"), buf[:200]
    return buf


def sse_payloads(raw: bytes) -> list[Any]:
    """The `data:` payloads of an SSE body: parsed JSON, or the string "[DONE]"."""
    import json

    out: list[Any] = []
    for block in raw.decode("utf-8").split("\n\n"):
        for line in block.splitlines():
            if line.startswith("data: "):
                data = line[len("data: "):]
                out.append(data if data == "[DONE]" else json.loads(data))
    return out


# -- soak traffic (tests/test_server_soak.py; bench/soak.py against `core serve`) -------------

SOAK_KINDS = ("complete", "chat_stream", "cut_stream", "generate_n2", "bad_request", "probe")


async def soak_traffic(url: str, key: str | None, duration: float, concurrency: int = 8,
                       max_tokens: int = 8, model: str | None = None,
                       on_tick: Any = None) -> dict[str, Any]:
    """Mixed client traffic for `duration` seconds from `concurrency` workers: non-streaming
    completions, chat streams read to the end, streams cut after their first event, /generate
    with n=2, malformed requests (must be 4xx) and health / metrics probes.

    Returns counts: {"requests", "ok", "client_error" (expected 4xx), "overloaded" (503 with
    Retry-After: the admission limit working), "server_error" (5xx otherwise), "transport"
    (connection failures), "unexpected" (a wrong answer), "by_kind": {...}, "examples": [...]}.
    `on_tick()` is called about once a second (bench/soak.py samples RSS there)."""
    import json
    import random
    import time

    import aiohttp

    hdrs = {"Authorization": f"Bearer {key}"} if key else {}
    counts: dict[str, Any] = {"requests": 0, "ok": 0, "client_error": 0, "overloaded": 0,
                              "server_error": 0, "transport": 0, "unexpected": 0,
                              "by_kind": {k: 0 for k in SOAK_KINDS}, "examples": []}
    end = time.monotonic() + duration
    words = ["alpha", "beta", "gamma", "delta", "the", "quick", "brown", "fox", "jumps"]

    def note(outcome: str, what: str) -> None:
        counts[outcome] += 1
        if outcome in ("server_error", "transport", "unexpected") and \
                len(counts["examples"]) < 20:
            counts["examples"].append(what)

    def classify(status: int, headers: Any, expect_4xx: bool = False) -> str:
        if status == 503 and "Retry-After" in headers:
            return "overloaded"
        if status >= 500:
            return "server_error"
        if status >= 400:
            return "client_error" if expect_4xx else "unexpected"
        return "unexpected" if expect_4xx else "ok"

    async def one(sess: aiohttp.ClientSession, rng: random.Random) -> None:
        kind = rng.choice(SOAK_KINDS)
        counts["by_kind"][kind] += 1
        counts["requests"] += 1
        prompt = " ".join(rng.choice(words) for _ in range(rng.randint(1, 12)))
        extra = {"model": model} if model else {}
        if kind == "complete":
            async with sess.post(url + "/v1/completions", json={
                    "prompt": prompt, "max_tokens": rng.randint(1, max_tokens), **extra},
                    headers=hdrs) as r:
                body = await r.read()
                out = classify(r.status, r.headers)
                if out == "ok" and "choices" not in json.loads(body):
                    out = "unexpected"
                note(out, f"complete {r.status} {body[:200]!r}")
        elif kind in ("chat_stream", "cut_stream"):
            async with sess.post(url + "/v1/chat/completions", json={
                    "messages": [{"role": "user", "content": prompt}], "stream": True,
                    "max_tokens": rng.randint(2, max_tokens), **extra}, headers=hdrs) as r:
                if r.status != 200:
                    body = await r.read()
                    note(classify(r.status, r.headers), f"{kind} {r.status} {body[:200]!r}")
                    return
                if kind == "cut_stream":
                    await r.content.readuntil(b"\n\n")
                    r.close()  # the client goes away mid-stream
                    note("ok", "")
                    return
                raw = await r.read()
                ok = raw.rstrip().endswith(b"data: [DONE]") and b'"error"' not in raw
                note("ok" if ok else "unexpected", f"chat_stream {raw[-200:]!r}")
        elif kind == "generate_n2":
            async with sess.post(url + "/generate", json={
                    "text": prompt, "sampling_params": {
                        "max_new_tokens": rng.randint(1, max_tokens), "n": 2}},
                    headers=hdrs) as r:
                body = await r.read()
                out = classify(r.status, r.headers)
                if out == "ok" and len(json.loads(body)) != 2:
                    out = "unexpected"
                note(out, f"generate {r.status} {body[:200]!r}")
        elif kind == "bad_request":
            bad = rng.choice([b"{not json", json.dumps({"prompt": 5}).encode(),
                              json.dumps({"prompt": "x", "max_tokens": -1}).encode(),
                              json.dumps({"messages": []}).encode()])
            path = rng.choice(["/v1/completions", "/v1/chat/completions"])
            async with sess.post(url + path, data=bad, headers={
                    **hdrs, "Content-Type": "application/json"}) as r:
                body = await r.read()
                out = classify(r.status, r.headers, expect_4xx=True)
                if out == "client_error" and "error" not in json.loads(body):
                    out = "unexpected"
                note(out, f"bad_request {r.status} {body[:200]!r}")
        else:
            path = rng.choice(["/health", "/ready", "/metrics", "/v1/models"])
            async with sess.get(url + path, headers=hdrs) as r:
                await r.read()
                ok = r.status == 200 or (path == "/ready" and r.status == 503)
                note("ok" if ok else "unexpected", f"probe {path} {r.status}")

    async def worker(i: int) -> None:
        rng = random.Random(i)
        timeout = aiohttp.ClientTimeout(total=300)
        async with aiohttp.ClientSession(timeout=timeout) as sess:
            while time.monotonic() < end:
                try:
                    await one(sess, rng)
                except (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError) as e:
                    note("transport", f"{type(e).__name__}: {e}")
                except ValueError as e:  # a body that is not the JSON it should be
                    note("unexpected", f"{type(e).__name__}: {e}")

    async def ticker() -> None:
        while time.monotonic() < end:
            if on_tick is not None:
                on_tick()
            await asyncio.sleep(1.0)

    await asyncio.gather(ticker(), *(worker(i) for i in range(concurrency)))
    return counts


# -- a `core serve` subprocess ------------------------------------------------------------------

def free_port() -> int:
    """A loopback port nobody listens on now."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def read_until_listening(proc: Any, timeout: float = 240.0) -> str:
    """The output of a `core serve` subprocess (stdout piped, text mode, stderr merged) up to
    and including its "listening on" line, or all it printed before exiting or `timeout`."""
    import time

    lines: list[str] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if "listening on" in line:
            break
    return "".join(lines)
