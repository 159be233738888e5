"""The API-key check: every route is guarded unless it is on the public allow-list.

core.server.app's one middleware calls `authorize(request, key)` before the route's handler, so
a refusal leaves in OpenAI's error shape like any other error.

Guarding by default means a route added later is protected without anyone remembering to. The
check uses the route aiohttp resolved (not the raw path), so `/health/../v1/models` tricks nothing.
Public: the liveness and readiness probes and /metrics, which run no engine work.
`/health_generate` runs a real (if bounded) engine request, so it needs the key like the API.

The key comes from `--api-key`, `--api-key-file` (keeps it out of the process command line) or
the CORE_API_KEY environment variable, in that order; an empty key is refused, never taken as
"authentication off".
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Mapping

from aiohttp import web

from core.server.errors import APIError

PUBLIC_ROUTES = frozenset({"/health", "/ready", "/metrics"})
API_KEY_ENV = "CORE_API_KEY"
# RFC 6750: a 401 names the scheme the client should use
CHALLENGE = {"WWW-Authenticate": 'Bearer realm="core-serve"'}

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


def check_api_key(key: str, source: str) -> str:
    """The key itself, or ValueError: empty, or holding whitespace or control characters (which
    an Authorization header cannot carry intact)."""
    if not key:
        raise ValueError(f"{source} is empty; give a key, or leave it out to serve without "
                         f"authentication")
    if any(c.isspace() or not c.isprintable() for c in key):
        raise ValueError(f"{source} holds whitespace or control characters")
    return key


def resolve_api_key(api_key: str | None, api_key_file: str | None,
                    environ: Mapping[str, str] | None = None) -> str | None:
    """The API key the server enforces (None: no authentication); ValueError says what is wrong.

    --api-key and --api-key-file exclude each other; CORE_API_KEY is read only when neither is
    given. A file may end with one newline (as `echo KEY > file` writes it)."""
    environ = os.environ if environ is None else environ
    if api_key is not None and api_key_file is not None:
        raise ValueError("give --api-key or --api-key-file, not both")
    if api_key is not None:
        return check_api_key(api_key, "--api-key")
    if api_key_file is not None:
        try:
            with open(api_key_file, encoding="utf-8") as fh:
                text = fh.read()
        except OSError as e:
            raise ValueError(f"--api-key-file {api_key_file}: {e.strerror or e}") from None
        except UnicodeDecodeError:
            raise ValueError(f"--api-key-file {api_key_file}: not UTF-8 text") from None
        return check_api_key(text.removesuffix("\n").removesuffix("\r"),
                             f"--api-key-file {api_key_file}")
    if API_KEY_ENV in environ:
        return check_api_key(environ[API_KEY_ENV], f"the environment variable {API_KEY_ENV}")
    return None


def authorize(request: web.Request, expected: bytes | None) -> None:
    """Raise APIError 401 unless the request presents `expected` (the key's UTF-8 bytes; None:
    every route is open) or its route is public."""
    if expected is None:
        return
    resource = request.match_info.route.resource
    if resource is not None and resource.canonical in PUBLIC_ROUTES:
        return
    presented = _presented_key(request)
    if presented is None:
        raise APIError(401, "missing API key: send the header 'Authorization: Bearer <key>'",
                       code="missing_api_key", headers=CHALLENGE)
    if not hmac.compare_digest(presented, expected):
        raise APIError(401, "invalid API key", code="invalid_api_key",
                       headers={"WWW-Authenticate": CHALLENGE["WWW-Authenticate"]
                                + ', error="invalid_token"'})
