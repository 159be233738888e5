"""`core serve`: start the engine, print the plan, listen, and drain on SIGTERM.

Shutdown order on SIGTERM / SIGINT: refuse new work (503 on open connections, the listening
socket closed), let in-flight requests finish for up to --drain-timeout seconds (a second signal
cuts the wait short), cancel what is left (which aborts it in the engine), then stop the engine
and every process it started.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys

from aiohttp import web

from core.config import ServerArgs
from core.server.app import create_app
from core.server.engine_api import EngineLike
from core.server.state import STATE

log = logging.getLogger("core.server")

CLEANUP_TIMEOUT_S = 2.0  # after the drain, how long aiohttp waits for handlers it cancels


def _address(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


async def run_server(engine: EngineLike, args: ServerArgs) -> int:
    """Serve `engine` until SIGTERM / SIGINT, then drain; returns the exit code."""
    app = create_app(engine, args)
    st = app[STATE]
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=CLEANUP_TIMEOUT_S,
                           access_log=log if args.log_requests else None)
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
    signals = asyncio.Queue[int]()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, signals.put_nowait, sig)
    try:
        sig = await signals.get()
        st.draining = True
        print(f"core serve: {signal.Signals(sig).name}: draining {st.inflight} request(s) "
              f"for up to {args.drain_timeout:g}s", flush=True)
        await site.stop()  # new connections are refused from here on
        waiter = asyncio.ensure_future(st.idle.wait())
        second = asyncio.ensure_future(signals.get())
        await asyncio.wait({waiter, second}, timeout=args.drain_timeout,
                                     return_when=asyncio.FIRST_COMPLETED)
        for f in (waiter, second):
            f.cancel()
        if st.inflight:
            print(f"core serve: aborting {st.inflight} unfinished request(s)", flush=True)
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        await runner.cleanup()  # cancels remaining handlers: their engine requests are aborted
        await engine.shutdown()
    print("core serve: stopped", flush=True)
    return 0


def serve_main(args: ServerArgs) -> int:
    """Entry point of `core serve` (called by core.cli with the resolved ServerArgs)."""
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO,
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from core.server.adapter import start_engine

    try:
        engine = start_engine(args)
    except Exception as e:  # a clear one-line reason; the engine already said what it knew
        from core.plan import ResolveError

        if isinstance(e, ResolveError):
            from core.resolver import error_table

            print(f"core serve: no plan fits:\n{error_table(e)}", file=sys.stderr)
        else:
            log.debug("engine start failed", exc_info=True)
            print(f"core serve: cannot start the engine: {e}", file=sys.stderr)
        return 2
    try:
        print(engine.describe_plan(), flush=True)
        return asyncio.run(run_server(engine, args))
    finally:
        engine.close()
