"""The HTTP server: OpenAI-compatible and SGLang-native routes on aiohttp.

`serve_main(args)` runs `core serve`; `create_app(engine, args)` builds the application over any
`EngineLike` (the real engine through core.frontend.serving, or conformance.server_kit.FakeEngine).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = ["EngineLike", "GenRequest", "create_app", "run_server", "serve_main"]

if TYPE_CHECKING:
    from core.plan.args import ServerArgs


def serve_main(args: ServerArgs) -> int:
    """Start the engine, print the plan and the address, serve until SIGTERM; exit code."""
    from core.server.serve import serve_main as _serve_main

    return _serve_main(args)


def __getattr__(name: str) -> Any:
    # aiohttp and the app are imported on first use, so `import core.server` stays cheap
    if name == "create_app":
        from core.server.app import create_app

        return create_app
    if name == "run_server":
        from core.server.serve import run_server

        return run_server
    if name in ("EngineLike", "GenRequest"):
        from core.server import engine_api

        return getattr(engine_api, name)
    raise AttributeError(name)
