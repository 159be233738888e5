"""Errors in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

import json
from typing import TypedDict

from aiohttp import web

from core.frontend.refusal import Refused

# OpenAI's error types by status (the `type` field); `code` is a finer machine-readable reason.
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_server_error",
    503: "service_unavailable_error",
}


class ErrorDetail(TypedDict):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorBody(TypedDict):
    """The body of every error answer (and a stream's error event)."""

    error: ErrorDetail


class APIError(Refused):
    """An error answered to the client with `status` and the OpenAI error body."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, type: str | None = None,
                 retry_after: int | None = None, headers: dict[str, str] | None = None):
        super().__init__(status, message, param=param, code=code, retry_after=retry_after)
        self.type = type or _TYPES.get(status, "invalid_request_error" if status < 500
                                       else "internal_server_error")
        self.headers = dict(headers or {})

    @staticmethod
    def of(exc: Refused) -> APIError:
        """The server's error for the engine's refusal (itself when it is one already)."""
        if isinstance(exc, APIError):
            return exc
        return APIError(exc.status, exc.message, param=exc.param, code=exc.code,
                        retry_after=exc.retry_after)

    def body(self) -> ErrorBody:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    def response(self) -> web.Response:
        headers = dict(self.headers)
        if self.retry_after is not None:
            headers["Retry-After"] = str(self.retry_after)
        return web.Response(status=self.status, text=json.dumps(self.body()),
                            content_type="application/json", headers=headers)


def invalid(param: str | None, message: str, code: str = "invalid_value") -> APIError:
    """400 for a bad parameter; the message names it."""
    return APIError(400, message, param=param, code=code)


def overloaded(message: str = "the server's request queue is full; retry later",
               retry_after: int = 1) -> APIError:
    return APIError(503, message, code="queue_full", retry_after=retry_after)


def from_http_exception(exc: web.HTTPException) -> APIError:
    """aiohttp's own 404 / 405 / 413 ... re-dressed in the OpenAI shape."""
    status = exc.status
    if status == 404:
        return APIError(404, "no such route", code="route_not_found")
    if status == 405:
        allowed = sorted(getattr(exc, "allowed_methods", ()) or ())
        return APIError(405, "method not allowed on this route"
                        + (f"; allowed: {', '.join(allowed)}" if allowed else ""),
                        code="method_not_allowed",
                        headers={"Allow": ", ".join(allowed)} if allowed else None)
    if status == 413:
        return APIError(413, "request body is too large", code="request_too_large")
    return APIError(status, exc.reason or "request failed", code=None)
