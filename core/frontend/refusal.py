"""Why the engine will not run a request, in numbers an HTTP server answers with as they are."""

from __future__ import annotations


class Refused(Exception):
    """The engine refuses a request: `status` (HTTP's: 400 for the request's own fault, 503 when
    the engine is gone or its queue is full, as the worker's Finish carries it), the request
    field it names (`param`), a machine-readable `code`, and seconds to wait before retrying.
    core.server.errors.APIError is one too: the server answers every Refused in OpenAI's
    error shape."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, retry_after: int | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.retry_after = retry_after


def invalid(param: str | None, message: str, code: str = "invalid_value") -> Refused:
    """400 for a bad parameter; the message names it."""
    return Refused(400, message, param=param, code=code)
