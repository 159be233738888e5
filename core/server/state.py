"""What the handlers share: engine, args, metrics, admission and drain bookkeeping."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from aiohttp import web

from core.config import ServerArgs
from core.server.engine_api import EngineLike
from core.server.errors import APIError, overloaded
from core.server.metrics import ServerMetrics
from core.server.protocol import parse_json_body

HEALTH_TIMEOUT_S = 5.0  # an engine that does not answer a ping within this is wedged
HEALTH_GENERATE_TIMEOUT_S = 30.0

class ServerState:
    """What the handlers share: engine, args, metrics, admission and drain bookkeeping."""

    def __init__(self, engine: EngineLike, args: ServerArgs, tokenizer_threads: int = 2):
        self.engine = engine
        self.args = args
        self.metrics = ServerMetrics()
        self.model_name = args.served_model_name or engine.model_name
        self.served_names = frozenset({self.model_name})
        self.chat_template = _load_template(args.chat_template)
        self.pool = ThreadPoolExecutor(tokenizer_threads, thread_name_prefix="core-tokenize")
        self.started = time.time()
        self.draining = False
        self.inflight = 0  # generation requests being served
        self.active_sequences = 0  # engine requests they make
        self.health_timeout = HEALTH_TIMEOUT_S
        self.idle = asyncio.Event()
        self.idle.set()
        # the server's own bound on work it accepts; the engine enforces its queue limit too
        mr, mq = args.max_running_requests, args.max_queued_requests
        self.max_sequences = mr + mq if mr is not None and mq is not None else None

    def refuse_if_draining(self) -> None:
        if self.draining:
            raise APIError(503, "the server is shutting down", code="shutting_down",
                           retry_after=5)

    @contextlib.contextmanager
    def admitted(self, k: int) -> Iterator[None]:
        if self.max_sequences is not None and self.active_sequences + k > self.max_sequences:
            raise overloaded(f"the server is at capacity ({self.active_sequences} sequences "
                             f"running or queued, limit {self.max_sequences}); retry later")
        self.active_sequences += k
        self.inflight += 1
        self.idle.clear()
        try:
            yield
        finally:
            self.active_sequences -= k
            self.inflight -= 1
            if self.inflight == 0:
                self.idle.set()

    async def read_json(self, request: web.Request) -> dict[str, Any]:
        limit = self.args.max_request_bytes
        if request.content_length is not None and request.content_length > limit:
            raise APIError(413, f"request body is {request.content_length} bytes; the limit is "
                           f"{limit} (--max-request-bytes)", code="request_too_large")
        try:
            raw = await request.read()  # client_max_size bounds chunked bodies too
        except web.HTTPRequestEntityTooLarge:
            raise APIError(413, f"request body is over the limit of {limit} bytes "
                           "(--max-request-bytes)", code="request_too_large") from None
        return parse_json_body(raw)

    async def engine_alive(self) -> bool:
        try:
            return bool(await asyncio.wait_for(self.engine.health(), self.health_timeout))
        except Exception:
            return False

    async def engine_stats(self) -> dict[str, Any]:
        try:
            return dict(await asyncio.wait_for(self.engine.stats(), self.health_timeout))
        except Exception:
            return {}


def _load_template(value: str | None) -> str | None:
    """--chat-template is a file path or the template itself."""
    if value and os.path.isfile(value):
        with open(value, encoding="utf-8") as fh:
            return fh.read()
    return value


def state(request: web.Request) -> ServerState:
    return request.app[STATE]


STATE = web.AppKey("state", ServerState)
# per-request outcome override for the request counter (aiohttp >= 3.12 has typed request keys)
OUTCOME: Any = web.RequestKey("outcome", str) if hasattr(web, "RequestKey") else "outcome"
