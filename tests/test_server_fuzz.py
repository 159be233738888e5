"""Property-based API fuzzing (issue 16): request bodies generated from the server's own
/openapi.json, mixed with arbitrary JSON, wrong types and raw bytes, sent to every POST route of a
server on the fake engine; GET routes with fuzzed paths and methods. Whatever comes in, the answer
is never a 5xx and every error is in OpenAI's shape. Bounded in time (FUZZ_BUDGET_S in all)."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from conformance.server_kit import FakeEngine, ServerThread, http_request, sse_payloads  # noqa: E402
from core.plan.args import ServerArgs  # noqa: E402
from core.server.app import create_app  # noqa: E402

KEY = "sk-fuzz"
AUTH = {"Authorization": f"Bearer {KEY}"}
FUZZ_BUDGET_S = 30.0  # split over the tests below; each stops generating when its share is spent
EXAMPLES = 400


@pytest.fixture(scope="module")
def srv():
    # short replies and a small context keep each request quick
    eng = FakeEngine(context_length=96, reply="ok ")
    with ServerThread(create_app(eng, ServerArgs(api_key=KEY, max_running_requests=8,
                                                 max_queued_requests=8))) as s:
        spec = json.loads(http_request(s.url, "GET", "/openapi.json", None, AUTH)[2])
        yield s, spec, eng


# -- a JSON-schema-guided strategy (what openapi.py uses; unknown keywords are ignored) ---------

JSON = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70)
                    | st.floats(allow_nan=False) | st.text(max_size=20),
                    lambda kids: st.lists(kids, max_size=4)
                    | st.dictionaries(st.text(max_size=8), kids, max_size=4), max_leaves=10)


def _resolve(schema: dict[str, Any], root: dict[str, Any]) -> dict[str, Any]:
    while "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[1]
        schema = root["components"]["schemas"][name]
    return schema


def from_schema(schema: dict[str, Any], root: dict[str, Any], depth: int = 0
                ) -> st.SearchStrategy:
    """Values mostly valid for `schema`, sometimes not (any JSON): both are worth sending."""
    schema = _resolve(schema, root)
    if depth > 4:
        return JSON
    wild = JSON if depth else st.nothing()  # a wrong type in place of a field
    if "const" in schema:
        return st.just(schema["const"]) | wild
    if "enum" in schema:
        return st.sampled_from(schema["enum"]) | wild
    for key in ("oneOf", "anyOf"):
        if key in schema:
            return st.one_of([from_schema(s, root, depth + 1) for s in schema[key]])
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = kind[0]
    if kind == "string":
        return st.text(min_size=schema.get("minLength", 0),
                       max_size=min(schema.get("maxLength", 40), 40)) | wild
    if kind == "integer":
        lo, hi = schema.get("minimum"), schema.get("maximum")
        near = st.integers(lo if lo is not None else -5, hi if hi is not None else 300)
        return near | st.integers(-2**64, 2**64) | wild
    if kind == "number":
        lo, hi = schema.get("minimum", -3.0), schema.get("maximum", 3.0)
        return st.floats(lo, hi, allow_nan=False) | st.floats(allow_nan=False) | wild
    if kind == "boolean":
        return st.booleans() | wild
    if kind == "null":
        return st.none()
    if kind == "array":
        items = from_schema(schema.get("items", {}), root, depth + 1)
        return st.lists(items, min_size=min(schema.get("minItems", 0), 3),
                        max_size=min(schema.get("maxItems", 3), 3)) | wild
    if kind == "object" or "properties" in schema:
        props = schema.get("properties") or {}
        if not props:
            return st.dictionaries(st.text(max_size=6), JSON, max_size=2) | wild
        required = [k for k in schema.get("required", []) if k in props]
        optional = [k for k in props if k not in required]

        @st.composite
        def obj(draw: Any) -> dict[str, Any]:
            keys = required + draw(st.lists(st.sampled_from(optional), max_size=6,
                                            unique=True)) if optional else list(required)
            out = {k: draw(from_schema(props[k], root, depth + 1)) for k in keys}
            if draw(st.integers(0, 9)) == 0:  # now and then a field nobody defines
                out[draw(st.text(min_size=1, max_size=8))] = draw(JSON)
            if required and draw(st.integers(0, 9)) == 0:  # or a required one missing
                out.pop(draw(st.sampled_from(required)), None)
            return out

        return obj() | wild
    return JSON


# -- the properties ----------------------------------------------------------------------------

def check_answer(status: int, headers: dict[str, str], raw: bytes, what: Any) -> None:
    assert status < 500, (status, raw[:300], what)
    ctype = headers.get("content-type", "")
    if status >= 400:
        assert ctype.startswith("application/json"), (status, ctype, what)
        err = json.loads(raw)["error"]
        assert set(err) == {"message", "type", "param", "code"}, err
        assert isinstance(err["message"], str) and err["message"]
        return
    if ctype.startswith("text/event-stream"):
        events = sse_payloads(raw)
        assert events and events[-1] == "[DONE]", raw[-300:]
        for e in events[:-1]:
            assert "error" not in e or e["error"]["code"] not in ("internal_error",), e
    elif ctype.startswith("application/json"):
        json.loads(raw)
    else:
        assert ctype.startswith("text/plain"), (ctype, what)  # /metrics


def _budget(share: float) -> float:
    return time.monotonic() + FUZZ_BUDGET_S * share


ROUTES = [("/v1/completions", "CompletionRequest"),
          ("/v1/chat/completions", "ChatCompletionRequest"),
          ("/generate", "GenerateRequest")]


@pytest.mark.parametrize("path,schema", ROUTES)
def test_post_routes_never_5xx(srv, path, schema):
    s, spec, eng = srv
    assert schema in spec["components"]["schemas"], "the OpenAPI document changed names"
    strategy = from_schema({"$ref": f"#/components/schemas/{schema}"}, spec)
    end = _budget(0.25)
    sent = []

    @settings(max_examples=EXAMPLES, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(body=strategy)
    def run(body: Any) -> None:
        if time.monotonic() > end:
            return
        sent.append(1)
        status, headers, raw = http_request(s.url, "POST", path, body, AUTH, timeout=30)
        check_answer(status, headers, raw, body)

    run()
    assert len(sent) >= 50  # the budget let a fair number through
    assert s.call(lambda: len(eng.active)) == 0  # nothing left running


def test_raw_bodies_methods_and_paths_never_5xx(srv):
    s, spec, _ = srv
    end = _budget(0.25)
    paths = sorted(spec["paths"])
    path_st = st.sampled_from(paths) | st.text(
        st.characters(min_codepoint=33, max_codepoint=126, exclude_characters="#?%"),
        max_size=12).map(lambda t: "/v1/models/" + t)
    sent = []

    @settings(max_examples=EXAMPLES, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(path=path_st, method=st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH"]),
           body=st.binary(max_size=64) | JSON.map(lambda v: json.dumps(v).encode()),
           ctype=st.sampled_from(["application/json", "text/plain",
                                  "application/x-www-form-urlencoded", ""]),
           anonymous=st.booleans())
    def run(path: str, method: str, body: bytes, ctype: str, anonymous: bool) -> None:
        if time.monotonic() > end:
            return
        sent.append(1)
        headers = {} if anonymous else dict(AUTH)
        if method == "GET":
            body = None
        else:
            headers["Content-Type"] = ctype
        status, hdrs, raw = http_request(s.url, method, path, body, headers, timeout=30)
        check_answer(status, hdrs, raw, (method, path, body, headers))

    run()
    assert len(sent) >= 50
