"""The aiohttp application: state, middlewares, and the routes that are not generation.

`create_app(engine, args)` is all a caller needs; `serve_main` (core.server.serve) adds the
listening socket, the plan banner and SIGTERM draining.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
import uuid
from typing import TYPE_CHECKING, TypedDict

from aiohttp import web

import core
from core.frontend.refusal import Refused
from core.plan.args import ServerArgs
from core.server import generation
from core.server.auth import PUBLIC_ROUTES, authorize, resolve_api_key
from core.server.engine_api import EngineLike, GenRequest
from core.server.errors import APIError, from_http_exception
from core.server.openapi import openapi_spec
from core.server.state import (
    HEALTH_GENERATE_CACHE_S,
    HEALTH_GENERATE_TIMEOUT_S,
    OUTCOME,
    STATE,
    ServerState,
    state,
)

if TYPE_CHECKING:
    from aiohttp.typedefs import Handler

    from core.contract.json_types import JSONObject

log = logging.getLogger("core.server")

UNCOUNTED_ROUTES = frozenset({"/metrics"})  # scrapes would drown the request counts
SERVER_NAME = "core-serve"  # the Server header: no versions


def _outcome(request: web.Request, status: int) -> str:
    if OUTCOME in request:
        return request[OUTCOME]
    if status < 400:
        return "success"
    if status in (429, 503):
        return "rejected"
    return "client_error" if status < 500 else "server_error"


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """The API key checked (core.server.auth), then the route; every failure leaves in
    OpenAI's error shape; a client error is never a 500."""
    resource = request.match_info.route.resource
    endpoint = resource.canonical if resource is not None else "unmatched"
    st = state(request)
    try:
        authorize(request, st.api_key_bytes)
        resp = await handler(request)
    except APIError as e:
        resp = e.response()
    except web.HTTPException as e:
        if e.status < 400:
            raise
        resp = from_http_exception(e).response()
    except asyncio.CancelledError:  # client disconnected (handler cancellation)
        if endpoint not in UNCOUNTED_ROUTES:
            st.metrics.count_request(endpoint, "aborted")
        raise
    except Exception:
        log.exception("unexpected error on %s %s", request.method, request.path)
        resp = APIError(500, "internal server error; see the server log",
                        code="internal_error").response()
    if endpoint not in UNCOUNTED_ROUTES:
        st.metrics.count_request(endpoint, _outcome(request, resp.status))
    return resp


# -- routes -------------------------------------------------------------------------------------

async def completions(request: web.Request) -> web.StreamResponse:
    return await generation.handle(request, "completions")


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await generation.handle(request, "chat")


async def native_generate(request: web.Request) -> web.StreamResponse:
    return await generation.handle(request, "generate")


class ModelCard(TypedDict):
    """One entry of /v1/models (OpenAI's model object, with vLLM's root, parent and
    max_model_len: a LoRA adapter's root is its folder, its parent the served model)."""

    id: str
    object: str
    created: int
    owned_by: str
    root: str
    parent: str | None
    max_model_len: int


def _loras(st: ServerState) -> dict[str, str]:
    return (st.engine.lora_adapters() if hasattr(st.engine, "lora_adapters") else None) or {}


def _model_card(st: ServerState, adapter: str | None = None) -> ModelCard:
    info = st.engine.model_info()
    root = info.get("model_path") or st.model_name
    return {"id": adapter or st.model_name, "object": "model", "created": int(st.started),
            "owned_by": "core-serve", "root": _loras(st)[adapter] if adapter else root,
            "parent": st.model_name if adapter else None,
            "max_model_len": st.engine.context_length}


async def list_models(request: web.Request) -> web.Response:
    st = state(request)
    cards = [_model_card(st)] + [_model_card(st, name) for name in sorted(_loras(st))]
    return web.json_response({"object": "list", "data": cards})


async def get_model(request: web.Request) -> web.Response:
    st = state(request)
    name = request.match_info["model"]
    if name in st.served_names:
        return web.json_response(_model_card(st))
    if name in _loras(st):
        return web.json_response(_model_card(st, name))
    raise APIError(404, f"the model '{name}' does not exist", param="model",
                   code="model_not_found")


def _lora_body(body: JSONObject, load: bool) -> tuple[str, str | None]:
    """vLLM's body: lora_name (and, to load, lora_path); anything else is refused."""
    allowed = {"lora_name", "lora_path"} if load else {"lora_name"}
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise APIError(400, f"unknown field(s) {', '.join(unknown)} (this route takes "
                       f"{', '.join(sorted(allowed))})", param=unknown[0],
                       code="unknown_parameter")
    name, path = body.get("lora_name"), body.get("lora_path")
    if not isinstance(name, str) or not name.strip() or len(name) > 256:
        raise APIError(400, "lora_name must be a non-empty string of at most 256 characters",
                       param="lora_name", code="invalid_value")
    if load and (not isinstance(path, str) or not path.strip()):
        raise APIError(400, "lora_path must be the adapter's folder (a non-empty string)",
                       param="lora_path", code="invalid_value")
    return name, path if load else None


async def _update_lora(request: web.Request, load: bool) -> web.Response:
    """POST /load_lora_adapter, /unload_lora_adapter (and their /v1/ names, vLLM's): guarded
    by the API key like every non-public route; between the engine's steps."""
    st = state(request)
    st.refuse_if_draining()
    body = await st.read_json(request)
    name, path = _lora_body(body, load)
    if not hasattr(st.engine, "lora_adapters") or st.engine.lora_adapters() is None:
        raise APIError(400, "LoRA is off in this server (start it with --enable-lora)",
                       code="unsupported")
    if load and name in st.served_names:
        raise APIError(400, f"lora_name {name!r} is the served model's name",
                       param="lora_name", code="invalid_value")
    try:
        got = await st.engine.update_lora("load" if load else "unload", name, path)
    except Refused as e:
        raise APIError.of(e) from None
    verb = "loaded" if load else "unloaded"
    return web.json_response({"success": True, "message": f"LoRA adapter {name!r} {verb}",
                              "adapter": got,
                              "loaded_adapters": sorted(st.engine.lora_adapters() or ())})


async def load_lora_adapter(request: web.Request) -> web.Response:
    return await _update_lora(request, load=True)


async def unload_lora_adapter(request: web.Request) -> web.Response:
    return await _update_lora(request, load=False)


async def health(request: web.Request) -> web.Response:
    """Liveness: 200 while the engine process is alive (a busy engine is alive: this never waits
    for a scheduler step); 503 when it is gone or the server is draining."""
    st = state(request)
    if st.draining:
        return web.json_response({"status": "draining"}, status=503)
    if not await st.engine_alive():
        return web.json_response({"status": "engine_unavailable"}, status=503)
    return web.json_response({"status": "ok"})


class ReadyBody(TypedDict):
    status: str  # ok | draining | engine_unavailable | busy
    sequences: int
    max_sequences: int | None


async def ready(request: web.Request) -> web.Response:
    """Readiness: live, not draining, and room for one more request under the admission limit
    (--max-running-requests + --max-queued-requests); 503 "busy" while full."""
    st = state(request)
    body: ReadyBody = {"status": "ok", "sequences": st.active_sequences,
                       "max_sequences": st.max_sequences}
    if st.draining:
        return web.json_response({**body, "status": "draining"}, status=503)
    if not await st.engine_alive():
        return web.json_response({**body, "status": "engine_unavailable"}, status=503)
    if st.max_sequences is not None and st.active_sequences >= st.max_sequences:
        return web.json_response({**body, "status": "busy"}, status=503,
                                 headers={"Retry-After": "1"})
    return web.json_response(body)


async def _probe(st: ServerState) -> tuple[int, dict[str, str]]:
    """One token end to end through the scheduler; (status, body) for /health_generate."""
    rid = f"health-{uuid.uuid4().hex}"
    gr = GenRequest(rid=rid, input_ids=(0,), sampling={"max_new_tokens": 1, "temperature": 0.0})

    async def one() -> bool:
        async with contextlib.aclosing(st.engine.generate(gr)) as deltas:
            async for d in deltas:
                if d.finished:
                    return d.error is None
        return False

    result: tuple[int, dict[str, str]] = (503, {"status": "engine_unavailable"})
    try:
        with st.reserved([rid]):
            if await asyncio.wait_for(one(), HEALTH_GENERATE_TIMEOUT_S):
                result = (200, {"status": "ok"})
    except Refused as e:  # (an APIError is one)
        if e.status in (429, 503) and e.code == "queue_full":  # alive, but its queue is full
            result = (503, {"status": "busy"})
    except Exception:
        pass
    finally:
        st.engine.abort(rid)
    st.probe_result = (time.monotonic(), *result)
    return result


async def health_generate(request: web.Request) -> web.Response:
    """Health by generating one token end to end through the scheduler.

    Bounded so that it cannot be used to load the engine: at most one probe runs at a time
    (concurrent callers share its answer) and an answer is reused for HEALTH_GENERATE_CACHE_S.
    It needs the API key when one is set."""
    st = state(request)
    if st.draining:
        return web.json_response({"status": "draining"}, status=503)
    if not await st.engine_alive():  # not live: no probe, and no cached "ok" either
        return web.json_response({"status": "engine_unavailable"}, status=503)
    last = st.probe_result
    if last is not None and time.monotonic() - last[0] < HEALTH_GENERATE_CACHE_S:
        status, body = last[1], last[2]
    else:
        if st.probe is None or st.probe.done():
            st.probe = asyncio.ensure_future(_probe(st))
        status, body = await asyncio.shield(st.probe)  # a caller leaving does not cancel it
    headers = {"Retry-After": "1"} if body.get("status") == "busy" else None
    return web.json_response(body, status=status, headers=headers)


async def get_model_info(request: web.Request) -> web.Response:
    st = state(request)
    info = dict(st.engine.model_info())
    info.update({"served_model_name": st.model_name, "is_generation": True,
                 "context_length": st.engine.context_length,
                 "vocab_size": st.engine.vocab_size})
    return web.json_response(info)


def redacted_args(args: ServerArgs, key_set: bool = False) -> JSONObject:
    d = dataclasses.asdict(args)
    if d.get("api_key") or key_set:
        d["api_key"] = "<redacted>"
    return d


async def get_server_info(request: web.Request) -> web.Response:
    st = state(request)
    plan = st.engine.plan_dict()
    candidates = list((plan or {}).get("candidates") or [])
    body = {"version": core.__version__, "server_args": redacted_args(st.args, st.api_key is not None),
            "model": st.engine.model_info(), "served_model_name": st.model_name,
            "plan": plan, "candidates": candidates, "plan_table": st.engine.describe_plan(),
            "stats": await st.engine_stats(), "engine_alive": await st.engine_alive(),
            "draining": st.draining, "inflight_requests": st.inflight,
            "uptime_s": time.time() - st.started}
    # default=str: plan values are plain data, but a plugin's DeviceInfo.extra may hold anything
    return web.json_response(body, dumps=lambda o: json.dumps(o, default=str))


async def metrics(request: web.Request) -> web.Response:
    st = state(request)
    text = st.metrics.render(await st.engine_stats(), await st.engine_alive())
    return web.Response(text=text, content_type="text/plain", charset="utf-8",
                        headers={"X-Prometheus-Format": "0.0.4"})


async def openapi(request: web.Request) -> web.Response:
    eng = state(request).engine
    return web.json_response(openapi_spec(core.__version__, eng.context_length,
                                          eng.vocab_size))


async def _server_header(_request: web.Request, resp: web.StreamResponse) -> None:
    resp.headers["Server"] = SERVER_NAME


def create_app(engine: EngineLike, args: ServerArgs, tokenizer_threads: int = 2
               ) -> web.Application:
    """The application for `engine`; run it with handler_cancellation=True so that a client
    disconnecting cancels its handler (and so aborts its engine requests). Raises ValueError
    for an API key that cannot be used (empty, unreadable file)."""
    api_key = resolve_api_key(args.api_key, args.api_key_file)
    app = web.Application(client_max_size=args.max_request_bytes,
                          middlewares=[error_middleware])
    st = ServerState(engine, args, tokenizer_threads)
    st.api_key = api_key
    app[STATE] = st
    app.on_response_prepare.append(_server_header)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/v1/models/{model}", get_model)
    app.router.add_post("/generate", native_generate)
    for prefix in ("", "/v1"):  # SGLang's names and vLLM's
        app.router.add_post(f"{prefix}/load_lora_adapter", load_lora_adapter)
        app.router.add_post(f"{prefix}/unload_lora_adapter", unload_lora_adapter)
    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready)
    app.router.add_get("/health_generate", health_generate)
    app.router.add_get("/get_model_info", get_model_info)
    app.router.add_get("/get_server_info", get_server_info)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/openapi.json", openapi)

    async def close_pool(_app: web.Application) -> None:
        if st.probe is not None:
            st.probe.cancel()
        st.pool.shutdown(wait=False, cancel_futures=True)

    app.on_cleanup.append(close_pool)
    assert PUBLIC_ROUTES <= {r.resource.canonical for r in app.router.routes()}
    return app
