"""Issue 32, items 1-3: client constraints never reach a grammar library where a crash or a hang
could take the server down or stall other clients.

- Hostile constraints (the outside tester's reproductions: a `pattern` of 30,000 nested groups
  through /generate and through chat response_format, a chain of 10,000 $refs, a 700-deep
  schema) are a 400 naming the limit, from bounded pure-Python checks (core.contract.grammar_limits),
  and the server goes on serving. Before the fix each killed `core serve` with SIGSEGV.
- Compiles run in child processes (core.engine.grammar_compiler) with a deadline, are cancelled with
  their request, run two at a time, and show in stats and /metrics. A grammar backend that
  crashes (SIGSEGV) or hangs on one constraint (a third-party package, `hostile`, installed
  as a pip package would be) costs that request only.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest
from installed_plugin import install

from core.contract.grammar import Constraint, GrammarError
from core.contract.grammar_limits import LIMITS, LimitError, check_limits, nesting

REPO = Path(__file__).resolve().parent.parent

# the outside tester's reproductions
NESTED_PATTERN = {"type": "string", "pattern": "(" * 30_000 + "a" + ")" * 30_000}


def ref_chain(n: int) -> dict:
    defs = {f"d{i}": {"type": "array", "items": {"$ref": f"#/$defs/d{i + 1}"}} for i in range(n)}
    defs[f"d{n}"] = {"type": "string"}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


def deep_arrays(n: int) -> dict:
    s: dict = {"type": "string"}
    for _ in range(n):
        s = {"type": "array", "items": s}
    return s


def limit_error(kind: str, value: str) -> str:
    with pytest.raises(LimitError) as e:
        check_limits(kind, value, "response_format")
    return str(e.value)


# -- the limits (pure, fast) ---------------------------------------------------------------------

def test_hostile_constraints_are_refused_naming_the_limit_in_bounded_time():
    t0 = time.perf_counter()
    assert "a pattern in the JSON schema nests 30000 levels of groups; the limit is 128" in \
        limit_error("json_schema", json.dumps(NESTED_PATTERN))
    assert "nests more than 64 levels (local $refs followed)" in limit_error(
        "json_schema", json.dumps(ref_chain(3_000)))  # within the size limit: depth refuses it
    assert "characters; the limit is 262144" in limit_error(
        "json_schema", json.dumps(ref_chain(10_000)))
    assert "nests more than 64 levels" in limit_error("json_schema",
                                                      json.dumps(deep_arrays(700)))
    assert "the JSON nests too deeply to parse" in limit_error("json_schema",
                                                              "[" * 100_000 + "]" * 100_000)
    assert "the regex nests 3000 levels of parentheses" in limit_error(
        "regex", "(" * 3000 + "a" + ")" * 3000)
    assert "the ebnf nests 5000 levels" in limit_error(
        "ebnf", "root ::= " + "(" * 5000 + '"a"' + ")" * 5000)
    assert "10001 choices; the limit is 10000" in limit_error(
        "choice", json.dumps([f"c{i}" for i in range(10_001)]))
    assert time.perf_counter() - t0 < 5  # (not a timing test: a bound against a hang)


def test_real_schemas_pass_the_limits():
    recursive = {"$defs": {"node": {"type": "object", "properties": {
        "value": {"type": "integer"}, "children": {"type": "array",
                                                   "items": {"$ref": "#/$defs/node"}}}}},
                 "$ref": "#/$defs/node"}
    for schema in (recursive, deep_arrays(LIMITS.schema_depth - 1), ref_chain(40),
                   {"type": "object", "properties": {f"p{i}": {"type": "string",
                                                               "pattern": "^[a-z]+(-[a-z]+)*$"}
                                                     for i in range(500)}}):
        check_limits("json_schema", json.dumps(schema), "x")
    check_limits("regex", r"(\d{3})-((\d{3})-(\d{4}))|[(((]", "x")
    check_limits("ebnf", 'root ::= "((((((" item ("," item)*  # ((((\nitem ::= [a-z(]+', "x")


def test_nesting_skips_escapes_classes_and_quoted_text():
    assert nesting(r"\(\(\(a", "regex") == 0
    assert nesting("[(((]((a))", "regex") == 2
    assert nesting(r"[^\]((](a)", "regex") == 1
    assert nesting('root ::= "((((" (x)', "ebnf") == 1
    assert nesting("root ::= x # ((((\n", "ebnf") == 0


def test_the_constraint_shape_check_applies_the_limits():
    with pytest.raises(GrammarError, match="guided_json: a pattern in the JSON schema nests"):
        Constraint("json_schema", json.dumps(NESTED_PATTERN), source="guided_json").validate()


# -- a third-party backend that crashes or hangs on some constraints ----------------------------

HOSTILE = '''
import os, signal, time
from core.contract.capabilities import GrammarCaps
from core.contract.hookspecs import hookimpl

CORE_PLUGIN_API = ">=1.7,<2"


class Matcher:
    """Any token, never terminated."""

    def fill_bitmask(self, bitmask, row):
        bitmask[row] = -1

    def accept(self, token):
        return True

    def is_terminated(self):
        return False

    def reset(self):
        pass

    def close(self):
        pass


class Hostile:
    """regex "crash": SIGSEGV; "sleep:N": N seconds; "refuse": a GrammarError; else any text."""

    def __init__(self, *, tokenizer, vocab_size, stop_token_ids):
        pass

    def validate(self, c):
        pass

    def compile(self, c):
        from core.contract.grammar import GrammarError
        if c.value == "crash":
            os.kill(os.getpid(), signal.SIGSEGV)
        if c.value.startswith("sleep:"):
            time.sleep(float(c.value[6:]))
        if c.value == "refuse":
            raise GrammarError(f"{c.where}: refused by hostile")
        return c.value

    def serialize(self, compiled):
        return compiled.encode()

    def deserialize(self, data):
        return data.decode()

    def matcher(self, compiled):
        return Matcher()


@hookimpl
def core_register_grammar_backends(register):
    register("hostile", GrammarCaps(constraints={"regex"}, serialize=True), Hostile)
'''


@pytest.fixture(scope="module")
def hostile_site(tmp_path_factory):
    """The `hostile` backend as an installed package: a folder with it and its dist-info on
    PYTHONPATH, so that the worker and its compile processes discover it by entry point."""
    return install(tmp_path_factory.mktemp("hostile") / "site", "hostile_grammar", HOSTILE)


@pytest.fixture(scope="module")
def hostile_env(hostile_site):
    import sys

    from core.plan.registry import get_registry

    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(hostile_site), str(REPO)] + ([old] if old else []))
    sys.path.insert(0, str(hostile_site))
    get_registry(reload=True)
    yield
    sys.path.remove(str(hostile_site))
    if old is None:
        os.environ.pop("PYTHONPATH")
    else:
        os.environ["PYTHONPATH"] = old
    get_registry(reload=True)


@pytest.fixture(scope="module")
def engine(hostile_env):
    from core.frontend.offline import Engine
    from core.plan.args import ServerArgs

    eng = Engine(server_args=ServerArgs(max_total_tokens=2048, grammar_backend="hostile",
                                        grammar_compile_timeout=4))
    assert eng.plan.grammar_backend == "hostile"
    yield eng
    eng.close()


def regex(value: str, max_new_tokens: int = 4) -> dict:
    return {"max_new_tokens": max_new_tokens, "temperature": 0,
            "constraint": {"kind": "regex", "value": value, "source": "regex"}}


def finish(engine, params: dict, timeout: float = 60.0) -> tuple[dict, float]:
    t0 = time.monotonic()
    out: dict = {}
    done = threading.Event()

    def run():
        out.update(engine.generate("Hi", params))
        done.set()

    threading.Thread(target=run, daemon=True).start()
    assert done.wait(timeout), f"no answer within {timeout} s"
    return out["meta_info"]["finish_reason"], time.monotonic() - t0


def test_a_crashing_compile_refuses_that_request_and_the_engine_serves_on(engine):
    fin, _ = finish(engine, regex("crash"))
    assert fin["type"] == "abort" and fin["status_code"] == 400
    assert "grammar backend hostile crashed compiling this regex constraint (SIGSEGV)" in \
        fin["message"]
    fin, _ = finish(engine, regex("fine"))  # a fresh compile process takes the next one
    assert fin["type"] == "length"
    fin, _ = finish(engine, {"max_new_tokens": 3, "temperature": 0})
    assert fin["type"] == "length"
    s = engine.stats()
    assert s["grammar_compiles_crashed"] >= 1 and s["grammar_compiles_ok"] >= 1


def test_a_compile_past_its_deadline_is_refused_naming_the_flag(engine):
    fin, took = finish(engine, regex("sleep:60"))
    assert fin["status_code"] == 400 and "did not compile within 4 s " \
        "(--grammar-compile-timeout)" in fin["message"], fin
    assert took < 30
    assert engine.stats()["grammar_compiles_timeout"] >= 1


def test_a_slow_compile_stalls_neither_plain_requests_nor_other_compiles(engine):
    """The outside tester's stall: one slow grammar held every client. Now it holds one compile
    process: a plain request and another constraint's compile finish while it compiles (it
    ends at its deadline, 4 s after its process took it)."""
    order: list[str] = []
    slow_fin: dict = {}

    def slow():
        slow_fin.update(finish(engine, regex("sleep:600"))[0])
        order.append("slow")

    th = threading.Thread(target=slow, daemon=True)
    th.start()
    time.sleep(0.5)
    fin, _ = finish(engine, {"max_new_tokens": 3, "temperature": 0})
    order.append("plain")
    assert fin["type"] == "length"
    fin, _ = finish(engine, regex("other"))
    order.append("other")
    assert fin["type"] == "length"
    th.join(60)
    assert order == ["plain", "other", "slow"], order
    assert "did not compile within 4 s" in slow_fin["message"]


def test_a_compile_whose_requests_all_left_is_stopped(engine):
    """Item 3: the clients left, and the worker compiled on for a minute. Now the abort of the
    last request waiting on a compile kills its process."""
    before = engine.stats()
    chunks: list = []
    rid = engine.client.submit(None, regex("sleep:600"),
                               input_ids=engine.client.tokenizer.encode("Hi"),
                               sink=chunks.append)
    deadline = time.monotonic() + 30
    while engine.stats()["grammar_compiles_running"] < 1:  # a compile process took it
        assert time.monotonic() < deadline
        time.sleep(0.05)
    engine.abort(rid)
    while engine.stats()["grammar_compiles_cancelled"] == before["grammar_compiles_cancelled"]:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    s = engine.stats()
    assert s["grammar_compiles_running"] == 0 and s["compiling"] == 0
    assert chunks and chunks[-1].finish.type == "abort"
    fin, _ = finish(engine, regex("after"))
    assert fin["type"] == "length"


def test_a_library_refusal_is_a_400_naming_the_field(engine):
    fin, _ = finish(engine, regex("refuse"))
    assert fin["status_code"] == 400 and fin["message"] == "regex: refused by hostile"
    assert engine.stats()["grammar_compiles_refused"] >= 1


# -- through the server, on the real default backend ---------------------------------------------

@pytest.fixture(scope="module")
def server():
    pytest.importorskip("xgrammar")
    from conformance.server_kit import ServerThread
    from core.frontend.offline import Engine
    from core.frontend.serving import AsyncEngine
    from core.plan.args import ServerArgs
    from core.server.app import create_app

    args = ServerArgs(max_total_tokens=2048, grammar_backend="xgrammar")
    eng = Engine(server_args=args)
    try:
        with ServerThread(create_app(AsyncEngine(eng, "smollm2"), args)) as s:
            s.engine = eng
            yield s
    finally:
        eng.close()


def test_hostile_schemas_through_the_server_are_400s_and_it_keeps_serving(server):
    from conformance.server_kit import http_request

    def post(path: str, body: dict) -> tuple[int, dict]:
        status, _, raw = http_request(server.url, "POST", path, body, timeout=60)
        return status, json.loads(raw)

    cases = [
        ("/generate", {"text": "Hi", "sampling_params": {
            "max_new_tokens": 4, "json_schema": json.dumps(NESTED_PATTERN)}},
         "nests 30000 levels of groups; the limit is 128"),
        ("/v1/chat/completions", {"model": "smollm2", "max_tokens": 4,
                                  "messages": [{"role": "user", "content": "Hi"}],
                                  "response_format": {"type": "json_schema", "json_schema": {
                                      "name": "x", "schema": NESTED_PATTERN}}},
         "nests 30000 levels of groups"),
        ("/generate", {"text": "Hi", "sampling_params": {
            "max_new_tokens": 4, "json_schema": json.dumps(ref_chain(3_000))}},
         "nests more than 64 levels (local $refs followed)"),
        ("/generate", {"text": "Hi", "sampling_params": {
            "max_new_tokens": 4, "json_schema": json.dumps(deep_arrays(700))}},
         "nests more than 64 levels"),
    ]
    for path, body, words in cases:
        status, got = post(path, body)
        assert status == 400, (path, got)
        message = got.get("error", got).get("message", "")
        assert words in message, got
    status, got = post("/generate", {"text": "Hi", "sampling_params": {
        "max_new_tokens": 8, "temperature": 0, "regex": "(yes|no)"}})
    assert status == 200 and got["text"] in ("yes", "no"), got
    assert server.engine.client.health()


def test_compiles_show_in_metrics(server):
    from conformance.server_kit import http_request

    status, _, raw = http_request(server.url, "GET", "/metrics", timeout=30)
    text = raw.decode()
    assert status == 200
    assert "core_grammar_compiles_running 0" in text
    ok = [ln for ln in text.splitlines() if ln.startswith('core_grammar_compiles_total{outcome="ok"}')]
    assert ok and float(ok[0].split()[-1]) >= 1, text
