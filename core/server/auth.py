"""API-key check as a middleware: every route is guarded unless it is on the public allow-list.

Guarding by default means a route added later is protected without anyone remembering to. The
check uses the route aiohttp resolved (not the raw path), so `/health/../v1/models` tricks nothing.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable

from aiohttp import web

from core.server.errors import APIError

PUBLIC_ROUTES = frozenset({"/health", "/health_generate", "/metrics"})

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _presented_key(request: web.Request) -> bytes | None:
    auth = request.headers.get("Authorization")
    if auth is None:
        return None
    scheme, _, token = auth.strip().partition(" ")
    if scheme.lower() != "bearer":
        return None
    # Header values arrive as str (undecodable bytes kept as surrogates); compare as bytes so a
    # non-ASCII key is a plain mismatch, not a TypeError from compare_digest on non-ASCII str.
    return token.strip().encode("utf-8", "surrogateescape")


def make_auth_middleware(api_key: str | None) -> Callable:
    expected = api_key.encode("utf-8") if api_key else None

    @web.middleware
    async def auth_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        if expected is None:
            return await handler(request)
        route = request.match_info.route
        resource = route.resource
        canonical = resource.canonical if resource is not None else None
        if canonical in PUBLIC_ROUTES:
            return await handler(request)
        presented = _presented_key(request)
        if presented is None:
            raise APIError(401, "missing API key: send the header 'Authorization: Bearer <key>'",
                           code="missing_api_key")
        if not hmac.compare_digest(presented, expected):
            raise APIError(401, "invalid API key", code="invalid_api_key")
        return await handler(request)

    return auth_middleware
