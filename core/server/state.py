"""What the handlers share: engine, args, metrics, admission and drain bookkeeping.

Request ids. Every engine request has a rid that is unique among the requests in flight: the
server picks one (`gen-<uuid>`, children `<rid>-<i>` for n > 1 or a batch) unless a /generate
client gives a `rid`, which is then checked (RID_PATTERN) and refused with 400 when it or any of
its children's rids is in use; a refused request never touches the one in flight.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Protocol

from aiohttp import web

from core.plan.args import ServerArgs
from core.server.engine_api import EngineLike
from core.server.errors import APIError, invalid, overloaded
from core.server.metrics import ServerMetrics
from core.server.protocol import parse_json_body
from core.server.reasoning import ServerChatOptions
from core.server.tools import ServerTools

if TYPE_CHECKING:
    from core.contract.json_types import JSONObject

HEALTH_TIMEOUT_S = 5.0  # an engine that does not answer a ping within this is wedged
HEALTH_GENERATE_TIMEOUT_S = 30.0
HEALTH_GENERATE_CACHE_S = 2.0  # /health_generate answers from its last probe for this long
BODY_TIMEOUT_S = 30.0  # the whole request body must arrive within this (slow senders hold sockets)
RID_PATTERN = re.compile(r"[A-Za-z0-9._:-]{1,128}")
JSON_TYPES = ("application/json",)


class Cuttable(Protocol):
    """A generation job in flight (generation's), as cut_all ends it."""

    def cut(self, error: APIError) -> None: ...


class ServerState:
    """What the handlers share: engine, args, metrics, admission and drain bookkeeping."""

    def __init__(self, engine: EngineLike, args: ServerArgs, tokenizer_threads: int = 2):
        self.engine = engine
        self.args = args
        self.metrics = ServerMetrics()
        self.model_name = args.served_model_name or engine.model_name
        self.served_names = frozenset({self.model_name})
        self.tools = ServerTools.of_engine(engine)  # tool calling: the plan's parser
        # reasoning_content and chat_template_kwargs: the plan's reasoning parser
        self.chat_options = ServerChatOptions.of_engine(engine)
        self.pool = ThreadPoolExecutor(tokenizer_threads, thread_name_prefix="core-tokenize")
        self.started = time.time()
        self.draining = False
        self.inflight = 0  # generation requests being served
        self.active_sequences = 0  # engine requests they make
        self.health_timeout = HEALTH_TIMEOUT_S
        self.body_timeout = BODY_TIMEOUT_S
        self.api_key: str | None = None  # the key enforced (create_app resolves it)
        self.idle = asyncio.Event()
        self.idle.set()
        self.rids: set[str] = set()  # every engine rid (and client base rid) in flight
        self.jobs: set[Cuttable] = set()  # generation jobs in flight (generation._Job): cut_all
        # /health_generate's one engine request: its (status, body)
        self.probe: asyncio.Task[tuple[int, dict[str, str]]] | None = None
        self.probe_result: tuple[float, int, dict[str, str]] | None = None  # (when, status, body)
        # the server's own bound on work it accepts; the engine enforces its queue limit too.
        # Without --max-running-requests the engine's own default counts. Both limits are per
        # engine: --dp-size replicas hold that many times as much.
        dp = args.dp_size
        mq = args.max_queued_requests
        mr = args.max_running_requests or _engine_max_running(engine)
        mq, mr = (None if mq is None else dp * mq), (None if mr is None else dp * mr)
        self.max_running, self.max_queued = mr, mq
        self.max_sequences = mr + mq if mr is not None and mq is not None else None

    @property
    def api_key_bytes(self) -> bytes | None:
        """The key as core.server.auth.authorize compares it (None: no authentication)."""
        return None if self.api_key is None else self.api_key.encode("utf-8")

    def refuse_if_draining(self) -> None:
        if self.draining:
            raise APIError(503, "the server is shutting down", code="shutting_down",
                           retry_after=5)

    @contextlib.contextmanager
    def admitted(self, k: int) -> Iterator[None]:
        if self.max_sequences is not None and k > self.max_sequences:
            # retrying cannot help: 400, not 503
            raise APIError(400, f"this request needs {k} sequences (prompts x n) but the server "
                           f"holds at most {self.max_sequences} at once ({self.max_running} "
                           f"running + {self.max_queued} queued: --max-running-requests, "
                           f"--max-queued-requests); lower n or send fewer prompts",
                           param="n", code="too_many_sequences")
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

    def check_client_rid(self, rid: str | None) -> None:
        """A client-chosen rid must be short and plain (it reaches logs and the engine)."""
        if rid is not None and not RID_PATTERN.fullmatch(rid):
            raise invalid("rid", "rid must be 1..128 characters from A-Z a-z 0-9 . _ : -",
                          code="invalid_rid")

    @contextlib.contextmanager
    def reserved(self, rids: Iterable[str], job: Cuttable | None = None) -> Iterator[None]:
        """Hold `rids` for one request (and list `job` for cut_all); 400 if one is in use."""
        want = set(rids)
        taken = want & self.rids
        if taken:
            raise invalid("rid", f"request id {min(taken)!r} is in use by a request in flight; "
                          f"choose another rid, or send none and let the server choose",
                          code="duplicate_rid")
        self.rids |= want
        if job is not None:
            self.jobs.add(job)
        try:
            yield
        finally:
            self.rids -= want
            self.jobs.discard(job)

    def cut_all(self, error: APIError) -> int:
        """End every request in flight with `error` (drain timeout, engine death); how many."""
        jobs = list(self.jobs)
        for job in jobs:
            job.cut(error)
        return len(jobs)

    async def read_json(self, request: web.Request) -> JSONObject:
        # JSON only: a browser's cross-origin "simple" POST (text/plain, form types, or no
        # type at all) is refused before anything runs
        ctype = request.content_type
        if not (ctype in JSON_TYPES or (ctype.startswith("application/")
                                        and ctype.endswith("+json"))):
            given = request.headers.get("Content-Type")
            raise APIError(415, "the request body must be JSON sent with 'Content-Type: "
                           f"application/json' (got {given!r})" if given else
                           "the request has no Content-Type; send 'Content-Type: "
                           "application/json'", code="unsupported_media_type")
        limit = self.args.max_request_bytes
        if request.content_length is not None and request.content_length > limit:
            raise APIError(413, f"request body is {request.content_length} bytes; the limit is "
                           f"{limit} (--max-request-bytes)", code="request_too_large")
        try:
            # client_max_size bounds chunked bodies too; the timeout bounds slow senders
            raw = await asyncio.wait_for(request.read(), self.body_timeout)
        except web.HTTPRequestEntityTooLarge:
            raise APIError(413, f"request body is over the limit of {limit} bytes "
                           "(--max-request-bytes)", code="request_too_large") from None
        except asyncio.TimeoutError:  # TimeoutError from 3.11 on; a distinct class on 3.10
            raise APIError(408, f"the request body did not arrive within "
                           f"{self.body_timeout:g} s", code="request_timeout",
                           headers={"Connection": "close"}) from None
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


def _engine_max_running(engine: EngineLike) -> int | None:
    try:
        v = engine.model_info().get("max_running_requests")
    except Exception:
        return None
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None


def state(request: web.Request) -> ServerState:
    return request.app[STATE]


STATE = web.AppKey("state", ServerState)
# per-request outcome override for the request counter (aiohttp >= 3.12 has typed request keys)
OUTCOME: web.RequestKey[str] | str = (web.RequestKey("outcome", str) if hasattr(web, "RequestKey")
                                      else "outcome")
