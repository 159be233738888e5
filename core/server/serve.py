"""`core serve`: start the engine, print the plan, listen, and drain on SIGTERM.

Shutdown order on SIGTERM / SIGINT: refuse new work (503 on open connections, the listening
socket closed), let in-flight requests finish for up to --drain-timeout seconds (a second signal
cuts the wait short), end what is left with an error (a stream gets an error event and
`data: [DONE]`; its engine requests are aborted), then stop the engine and every process it
started.

Engine death: when the engine worker dies, the server does not restart it; it ends the requests
in flight with an error, stops listening and exits with status EXIT_ENGINE_DIED (4) within a few
seconds, so that a supervisor (systemd, Kubernetes) restarts the whole server.

Transport: connections idle for KEEPALIVE_S are closed; a request's headers must arrive within
HEADER_TIMEOUT_S of its first byte and its body within state.BODY_TIMEOUT_S; malformed HTTP is
answered in the OpenAI error shape without echoing the request, logged at debug level only and
counted in /metrics (endpoint "malformed_http"); the Server header names no versions.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import signal
import sys
from collections.abc import Callable
from typing import Any, TypeAlias

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from core.plan.args import ServerArgs
from core.server.app import SERVER_NAME, create_app
from core.server.engine_api import EngineLike
from core.server.errors import APIError
from core.server.state import STATE, ServerState

log = logging.getLogger("core.server")

CLEANUP_TIMEOUT_S = 2.0  # after the drain, how long aiohttp waits for handlers it cancels
KEEPALIVE_S = 75.0  # an idle keep-alive connection is closed after this (aiohttp's default: 3630)
HEADER_TIMEOUT_S = 10.0  # from a request's first byte to the end of its headers
WATCHDOG_S = 0.5  # how often the server checks that the engine is still there
ERROR_GRACE_S = 2.0  # how long requests that were just ended with an error get to say so
EXIT_ENGINE_DIED = 4

# what ends serving: ("signal", SIGTERM / SIGINT) or ("engine", the reason it stopped)
_Event: TypeAlias = tuple[str, signal.Signals | str]


def _address(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve anywhere
        return False


# -- transport ----------------------------------------------------------------------------------

class _Handler(RequestHandler):
    """aiohttp's connection handler with a header-read timeout and JSON error answers."""

    _header_timer: asyncio.TimerHandle | None = None

    # aiohttp's private state is read with getattr defaults: a version without one of these
    # fields loses the header timeout, not the connection
    def _busy(self) -> bool:
        return bool(getattr(self, "_request_in_progress", False))

    def data_received(self, data: bytes) -> None:
        before = getattr(self, "_request_count", 0)
        super().data_received(data)
        if getattr(self, "_request_count", 0) > before:  # a whole request head arrived
            self._cancel_header_timer()
        elif (self._header_timer is None and not self._busy() and self.transport is not None
              and not getattr(self, "_force_close", False)):
            # bytes of a request head (not a body being read): the rest must follow soon
            timeout = getattr(self._manager, "header_timeout", HEADER_TIMEOUT_S)
            self._header_timer = self._loop.call_later(timeout, self._header_timed_out)

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _header_timed_out(self) -> None:
        self._header_timer = None
        if not self._busy() and self.transport is not None:
            log.debug("closing a connection whose request headers did not arrive in time")
            self.force_close()

    def connection_lost(self, exc: BaseException | None) -> None:
        self._cancel_header_timer()
        super().connection_lost(exc)

    def handle_error(self, request: web.BaseRequest, status: int = 500,
                     exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        """Errors raised outside the application (malformed HTTP, mostly) in the OpenAI shape,
        without the request's bytes; a traceback is logged only for a server error."""
        if status >= 500:
            self.log_exception("error handling a request from %s", request.remote, exc_info=exc)
            err = APIError(status, "internal server error; see the server log",
                           code="internal_error")
        else:
            log.debug("malformed HTTP request from %s: %s", request.remote,
                      type(exc).__name__ if exc else status)
            counter = getattr(self._manager, "on_malformed", None)
            if counter is not None:
                counter()
            reason = type(exc).__name__ if exc is not None else "bad request"
            err = APIError(status, f"malformed HTTP request ({reason})",
                           code="bad_http_request")
        if request.writer.output_size > 0:
            raise ConnectionError("a response was sent already; cannot send the error")
        resp = err.response()
        resp.headers["Server"] = SERVER_NAME
        resp.force_close()
        return resp


class _Server(web.Server):
    header_timeout = HEADER_TIMEOUT_S
    on_malformed: Callable[[], None] | None = None

    def __call__(self) -> RequestHandler:
        return _Handler(self, loop=self._loop, **self._kwargs)


class _Runner(web.AppRunner):
    def __init__(self, app: web.Application, header_timeout: float, **kwargs: Any):
        super().__init__(app, **kwargs)
        self.header_timeout = header_timeout

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        server.__class__ = _Server  # aiohttp builds it; we choose the connection handler
        server.header_timeout = self.header_timeout
        st = self.app.get(STATE)
        if st is not None:
            server.on_malformed = lambda: st.metrics.count_request("malformed_http",
                                                                   "client_error")
        return server


def make_runner(app: web.Application, *, access_log: logging.Logger | None = None,
                keepalive: float = KEEPALIVE_S, header_timeout: float = HEADER_TIMEOUT_S,
                shutdown_timeout: float = CLEANUP_TIMEOUT_S) -> web.AppRunner:
    """The AppRunner `core serve` uses (tests use it too, through testing.ServerThread)."""
    return _Runner(app, header_timeout, handler_cancellation=True,
                   shutdown_timeout=shutdown_timeout, access_log=access_log,
                   keepalive_timeout=keepalive)


# -- running ------------------------------------------------------------------------------------

def _failure(engine: EngineLike) -> str | None:
    check = getattr(engine, "failure", None)  # optional for EngineLike implementations
    try:
        return check() if check is not None else None
    except Exception as e:  # a failing check is a failing engine
        return f"{type(e).__name__}: {e}"


async def _watch(engine: EngineLike, events: asyncio.Queue[_Event]) -> None:
    while True:
        await asyncio.sleep(WATCHDOG_S)
        reason = _failure(engine)
        if reason is not None:
            events.put_nowait(("engine", reason))
            return


async def _settle(st: ServerState, timeout: float) -> None:
    """Let requests that were just ended write their error, for up to `timeout` seconds."""
    try:
        await asyncio.wait_for(st.idle.wait(), timeout)
    except asyncio.TimeoutError:  # TimeoutError from 3.11 on
        pass


async def run_server(engine: EngineLike, args: ServerArgs) -> int:
    """Serve `engine` until SIGTERM / SIGINT, then drain; returns the exit code (0, or
    EXIT_ENGINE_DIED when the engine worker died)."""
    try:
        app = create_app(engine, args)
    except ValueError as e:  # an API key that cannot be used
        print(f"core serve: error: {e}", file=sys.stderr)
        return 2
    st = app[STATE]
    if st.api_key is None and not is_loopback(args.host):
        msg = (f"core serve: WARNING: listening on {args.host}, which is not a loopback "
               f"address, without an API key: anyone who can reach the port can use the "
               f"model; set --api-key-file or CORE_API_KEY")
        log.warning(msg.removeprefix("core serve: WARNING: "))
        print(msg, file=sys.stderr, flush=True)
    runner = make_runner(app, access_log=log if args.log_requests else None)
    await runner.setup()
    site = web.TCPSite(runner, args.host, args.port, reuse_address=True)
    try:
        await site.start()
    except OSError as e:
        print(f"core serve: cannot listen on {args.host}:{args.port}: {e.strerror or e}",
              file=sys.stderr)
        await runner.cleanup()
        return 1
    print(f"core serve: listening on {_address(args.host, args.port)} (model "
          f"{st.model_name!r})", flush=True)

    loop = asyncio.get_running_loop()
    events: asyncio.Queue[_Event] = asyncio.Queue()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, events.put_nowait, ("signal", sig))
    watchdog = asyncio.ensure_future(_watch(engine, events))
    rc = 0
    try:
        kind, what = await events.get()
        st.draining = True
        if kind == "engine":
            rc = EXIT_ENGINE_DIED
            print(f"core serve: the engine stopped ({what}); ending {st.inflight} request(s) "
                  f"and exiting with status {rc} so that a supervisor restarts the server",
                  file=sys.stderr, flush=True)
            await site.stop()
            st.cut_all(APIError(503, f"the engine stopped: {what}", code="engine_unavailable"))
            await _settle(st, ERROR_GRACE_S)
        else:
            print(f"core serve: {signal.Signals(what).name}: draining {st.inflight} "
                  f"request(s) for up to {args.drain_timeout:g}s", flush=True)
            await site.stop()  # new connections are refused from here on
            waiter = asyncio.ensure_future(st.idle.wait())
            second = asyncio.ensure_future(events.get())  # a second signal, or engine death
            await asyncio.wait({waiter, second}, timeout=args.drain_timeout,
                               return_when=asyncio.FIRST_COMPLETED)
            for f in (waiter, second):
                f.cancel()
            if second.done() and not second.cancelled() and second.result()[0] == "engine":
                rc = EXIT_ENGINE_DIED
            if st.inflight:
                print(f"core serve: ending {st.inflight} unfinished request(s) with an error",
                      flush=True)
                st.cut_all(APIError(503, "the server is shutting down: this request was cut "
                                    "at --drain-timeout", code="shutting_down"))
                await _settle(st, ERROR_GRACE_S)
    finally:
        watchdog.cancel()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        await runner.cleanup()  # cancels remaining handlers: their engine requests are aborted
        await engine.shutdown()
    print("core serve: stopped", flush=True)
    return rc


def serve_main(args: ServerArgs) -> int:
    """Entry point of `core serve` (called by core.cli with the resolved ServerArgs)."""
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO,
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from core.server.auth import resolve_api_key

    if args.node_rank > 0:  # another node's ranks of node 0's engine: no HTTP here
        from core.frontend.client import serve_node

        return serve_node(args)

    try:  # before the model loads: a bad key is a usage error
        resolve_api_key(args.api_key, args.api_key_file)
    except ValueError as e:
        print(f"core serve: error: {e}", file=sys.stderr)
        return 2
    # The engine's workers first, before this process imports torch (core.frontend.serving
    # does): their imports then overlap this process's imports and the plan's resolution.
    from core.frontend.prestart import StartedWorker

    started = [StartedWorker(args) for _ in range(args.dp_size)]
    try:
        from core.frontend.serving import start_async_engine

        engine = start_async_engine(args, started=started)
    except Exception as e:  # a clear one-line reason; the engine already said what it knew
        from core.plan.plan import ResolveError

        if isinstance(e, ResolveError):
            from core.plan.resolver import error_table

            print(f"core serve: no plan fits:\n{error_table(e)}", file=sys.stderr)
        else:
            log.debug("engine start failed", exc_info=True)
            print(f"core serve: cannot start the engine: {e}", file=sys.stderr)
        return 2
    try:
        print(engine.describe_plan(), flush=True)
        # the serving defaults the engine applied for its device (core.plan.args), shown as set
        args = args.replace(decode_itl_target_ms=engine.engine.args.decode_itl_target_ms)
        return asyncio.run(run_server(engine, args))
    finally:
        engine.close()
