"""The tool-call-parser conformance tests (core/contract/tools.py): the calls a parser writes read back,
one-shot and streamed in chunks, with no call markup streamed as content; plain text left alone;
malformed calls left as text; no crash on any input.

Collected by the conformance plugin (`pytest --conformance-tool-parser NAME`, see
conformance.plugin), or by importing them into a test module:

    from conformance.tool_parser_suite import *  # noqa: F401,F403

Parametrization: every registered tool-call parser whose packages are installed (or only those
named; a named one that cannot run is one skip with the reason) x every case (CASES). For a
named parser, a case its caps do not declare is one skip with the reason (`pytest -rs`): the
several-call cases without ToolParserCaps.parallel_calls, the tools prompt without prompts.

A parser is given text only (no tools, no tokenizer), so the suite writes the model's text with
the parser's own format_calls: `format_calls(calls)` alone, or after content and a newline (as
the core replays an assistant turn with content). The checks, as core/contract/tools.py states them:
- calls (one; none with empty arguments; several, the same function twice; arguments nesting
  objects and arrays, every JSON scalar, unicode, quotes, escapes and control characters,
  markup of this and other formats inside strings; names with dots and dashes; content before
  them): parse(text, final=True) gives back those calls (names, JSON-equal arguments, each
  complete, its raw text in the text) and that content (stripped, as the core strips it); the
  core's final message (core.server.tools.final_message) says the same.
- streaming: the text fed in chunks of 1, 3 and 7 characters and at token-like boundaries (a
  special token or a tag whole, words, spaces, punctuation pairs): at every step parse(prefix,
  final=False) only extends the step before and the final result: content only grows at its
  end (so no text is streamed that later turns out to be part of a call), a call's name once
  read stays, its arguments and raw text only grow; a call counts once its name is read and its
  arguments have begun, as the core sends it (earlier it is held back). The core's stream
  (ToolStream) joins to the final message: the same content, the same calls, argument fragments
  joined equal to the final strings.
- plain text (prose, braces, a JSON answer, code, markup-like text, each declared marker alone
  and half of it at the end, special and control characters, only spaces, nothing): no call,
  and the text back unchanged, streamed or not.
- malformed calls (arguments a string, an array, a number or null; truncated inside an argument
  value, after the name, before the closing brackets; after a complete call, after content):
  no call where the text holds none, and the text back verbatim (core/contract/tools.py: a call that is
  not well formed stays a str, markup included); a call whose arguments are visibly no object
  is never streamed as a call. A truncated call may have been streamed as a call before it
  broke (that cannot be taken back); its text still ends up as the content.
- calls to functions the request did not offer: the parser reads them (it is not given the
  tools); the core puts their raw text back into the content, streamed or not.
- nesting (core/contract/tools.py, MAX_ARGUMENT_DEPTH): arguments nested exactly to the limit
  read back as the call; one level deeper, 1,500 levels (past Python's recursion limit) and
  50,000: parse never raises, one-shot or streamed, and the text comes back verbatim, as
  content (such a call is not well formed), through the core too.
- robustness: mutations of the parser's own calls (characters deleted, inserted, duplicated,
  the text cut) and random strings of markup and JSON fragments: parse never raises, final
  results are well formed, a final result with no call is the text verbatim, and streamed
  content never has to be taken back.
- the tools prompt (where prompts is declared): a deterministic string naming every tool;
  format_response holds each result verbatim (spaces and newlines at its ends, unicode,
  escapes, markup and nothing at all included).
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest

from conformance.plugin import named_plugins
from core.contract.tools import MAX_ARGUMENT_DEPTH, ToolCall, ToolParser, json_depth
from core.server.tools import ToolRequest, ToolStream, final_message

__all__ = ["pytest_generate_tests", "test_tool_parser_conformance"]

STEPS = (1, 3, 7)  # chunk sizes, in characters; plus "tokens" (TOKEN below)
# token-like pieces: a special token or a tag whole, a word, spaces, one or two punctuation marks
TOKEN = re.compile(r"<\|[^|<>\s]{1,40}\|>|</?[A-Za-z_][\w.-]{0,30}>|\w+|\s+|[^\w\s]{1,2}")
SENTINEL = "CUT-HERE-7f3a"  # an argument value where the malformed cases cut the text


# -- the cases ------------------------------------------------------------------------------------

def call(name: str, **arguments: Any) -> dict[str, Any]:
    return {"name": name, "arguments": arguments}


WEATHER = call("get_weather", city="Paris", unit="celsius")
TIME = call("get_time")

ARGUMENTS: dict[str, dict[str, Any]] = {
    "nested": {"filter": {"range": {"min": 1, "max": 2.5}, "tags": ["a", "b"]},
               "deep": {"a": {"b": {"c": {"d": [{"e": None}, {}]}}}}},
    "arrays": {"ids": [1, 2, 3], "matrix": [[1, 2], [3, 4]], "empty": [], "objects":
               [{"k": "v"}, {}], "mixed": [1, "two", None, True, {"x": [3.5]}]},
    "scalars": {"yes": True, "no": False, "nothing": None, "int": -42, "zero": 0,
                "float": 3.14e-10, "big": 12345678901234567890, "neg": -0.5, "empty": ""},
    "unicode": {"city": "Zürich", "greeting": "こんにちは 🌍", "rtl": "שלום مرحبا",
                "combining": "e\u0301", "zwj": "👩\u200d💻", "ключ ключ": "значение"},
    "escapes": {"quote": 'He said "hi"', "apostrophe": "it's", "backslash": "C:\\path\\to\\",
                "newlines": "line1\nline2\r\n\ttab", "controls": "\u0001\u001f\u007f",
                "slash": "a/b", "separators": "\u2028\u2029", "bs-quote": '\\"', "braces":
                "}{][", "json": '{"name": "x", "arguments": {}}'},
}


@dataclass(frozen=True)
class Sample:
    """A model output the suite wrote with the parser's format: its text, the calls it holds,
    the content (as the core sends it, stripped) and the functions the request offers."""

    text: str
    calls: tuple[dict[str, Any], ...] = ()
    content: str = ""
    offered: tuple[str, ...] = ()
    truncated: bool = False  # a malformed sample cut short (its call may stream before it breaks)


@dataclass(frozen=True)
class Case:
    """One check of one parser. build(parser, caps) writes its sample(s); kind picks the check
    (check_case); needs: the ToolParserCaps flag it needs, "" when none."""

    id: str
    kind: str  # calls | plain | malformed | unknown | deep | robust | prompt
    build: Callable[[Any, Any], Any] = field(repr=False)
    needs: str = ""


def _calls_sample(calls: Sequence[dict[str, Any]], content: str = "") -> Callable:
    def build(parser, caps) -> Sample:
        text = parser.format_calls([dict(c) for c in calls])
        return Sample(content + "\n" + text if content else text, tuple(calls), content.strip())
    return build


def _markup(parser, caps) -> Sample:
    args = {"snippet": '<tool_call>{"name": "f", "arguments": {}}</tool_call>',
            "markers": " | ".join(caps.markers), "specials": "<|python_tag|> <|eot_id|> "
            "<|im_end|> [TOOL_CALLS] </s>", "close": "</tool_call>", "semicolon": "a; {b}"}
    return _calls_sample([call("render_html", **args)])(parser, caps)


def _plain(text: str | Callable[[Any], str]) -> Callable:
    def build(parser, caps) -> list[Sample]:
        texts = text(caps) if callable(text) else [text]
        return [Sample(t, (), t.strip()) for t in texts]
    return build


def _marker_texts(caps) -> list[str]:
    out = []
    for m in caps.markers:
        out += ["Say " + m, "Say " + m[:max(1, len(m) // 2)], m, m + "\n"]
    return out or ["no markers declared"]


SPECIAL = ("NUL \x00, controls \x01\x1b\x7f, replacement \ufffd, BOM \ufeff, separators "
           "\u2028\u2029, CJK 天气, emoji 🌦️👩\u200d💻, RTL مرحبا, combining e\u0301, "
           "backslashes \\ \\n \\u0041, quotes \" ' `, lone brackets } ] > |")


def _malformed(arguments: Any = None, cut: str = "", prefix: str = "",
               before: Sequence[dict[str, Any]] = ()) -> Callable:
    """A call whose arguments are `arguments` (not an object), or one cut (`cut`: "value"
    inside SENTINEL, "name" just after the name, "object" before the closing brackets), after
    `before` (complete calls) and `prefix` (content)."""
    def build(parser, caps) -> Sample:
        if cut:
            bad = call("get_weather", city="Paris", note=SENTINEL)
        else:
            bad = {"name": "get_weather", "arguments": arguments}
        try:
            text = parser.format_calls([*map(dict, before), bad])
        except Exception as exc:  # noqa: BLE001 - a format may not write such arguments
            pytest.skip(f"format_calls cannot write arguments {json.dumps(arguments)} "
                        f"({type(exc).__name__}: {exc})")
        if cut:
            at = {"value": text.rfind(SENTINEL) + 3,
                  "name": text.rfind("get_weather") + len("get_weather") + 1,
                  "object": text.rfind(SENTINEL) + len(SENTINEL) + 1}[cut]
            text = text[:at]
        return Sample(prefix + text, tuple(before), "", offered=("get_weather", "get_time"),
                      truncated=bool(cut))
    return build


def _unknown(parser, caps) -> Sample:
    text = parser.format_calls([call("not_offered", x=1)])
    return Sample(text, (call("not_offered", x=1),), "", offered=("get_weather",))


def _unknown_beside(parser, caps) -> Sample:
    calls = (WEATHER, call("not_offered", x=[1]), TIME)
    return Sample(parser.format_calls([dict(c) for c in calls]), calls, "",
                  offered=("get_weather", "get_time"))


CASES: tuple[Case, ...] = (
    Case("one-call", "calls", _calls_sample([WEATHER])),
    Case("empty-arguments", "calls", _calls_sample([TIME])),
    *(Case(f"arguments-{k}", "calls", _calls_sample([call("tool_" + k, **v)]))
      for k, v in ARGUMENTS.items()),
    Case("markup-in-arguments", "calls", _markup),
    Case("name-with-dots-and-dashes", "calls", _calls_sample([call("ns.get-weather_v2", a=1)])),
    Case("content-before", "calls", _calls_sample([WEATHER], "Let me check the weather.")),
    Case("unicode-content-before", "calls",
         _calls_sample([WEATHER], "Voilà — je vérifie 🌦️… {pas du JSON} <b>x</b>; fin")),
    Case("several-calls", "calls", _calls_sample(
        [WEATHER, TIME, call("get_weather", city="Tōkyō", days=[1, 2])]), "parallel_calls"),
    Case("content-before-several", "calls",
         _calls_sample([TIME, WEATHER], "Two calls:"), "parallel_calls"),
    Case("several-empty", "calls", _calls_sample([TIME, TIME]), "parallel_calls"),
    Case("plain-prose", "plain", _plain("The weather in Paris is mild; take a coat.\n")),
    Case("plain-braces", "plain", _plain(
        "Use a dict like {'a': 1} or {\"b\": 2}, a list [1, 2] and f(x); then stop.")),
    Case("plain-json-answer", "plain", _plain('{"answer": 42, "items": [1, {"k": null}]}')),
    Case("plain-brace-first", "plain", _plain("{maybe} this is not JSON at all")),
    Case("plain-code", "plain", _plain(
        "```python\nprint({'name': 'x', 'arguments': {}})\n```\nDone.")),
    Case("plain-markup-like", "plain", _plain(
        "a < b > c, <b>bold</b>, <tool>, <|not a token|>, [TOOL], <tool_cal ")),
    Case("plain-markers", "plain", _plain(_marker_texts)),
    Case("plain-special-characters", "plain", _plain(SPECIAL)),
    Case("plain-whitespace-only", "plain", _plain(" \n\t \n")),
    Case("plain-empty", "plain", _plain("")),
    Case("malformed-arguments-string", "malformed", _malformed("city=Paris")),
    Case("malformed-arguments-array", "malformed", _malformed(["Paris"])),
    Case("malformed-arguments-number", "malformed", _malformed(42)),
    Case("malformed-arguments-null", "malformed", _malformed(None)),
    Case("malformed-truncated-in-value", "malformed", _malformed(cut="value")),
    Case("malformed-truncated-after-name", "malformed", _malformed(cut="name")),
    Case("malformed-truncated-object", "malformed", _malformed(cut="object")),
    Case("malformed-after-content", "malformed", _malformed(cut="value", prefix="Sure. ")),
    Case("malformed-not-object-after-content", "malformed", _malformed([1], prefix="Ok.\n")),
    Case("malformed-after-a-call", "malformed", _malformed(cut="value", before=[TIME]),
         "parallel_calls"),
    Case("unknown-function", "unknown", _unknown),
    Case("unknown-beside-known", "unknown", _unknown_beside, "parallel_calls"),
    Case("deep-arguments", "deep", lambda parser, caps: None),
    Case("robust-mutations", "robust", lambda parser, caps: None),
    Case("robust-fragments", "robust", lambda parser, caps: None),
    Case("tools-prompt", "prompt", lambda parser, caps: None, "prompts"),
)

NEEDS = {"parallel_calls": "does not declare parallel_calls (one call per answer)",
         "prompts": "does not declare prompts (no tools prompt)"}


# -- parametrization ------------------------------------------------------------------------------

def _skip(id: str, reason: str):
    return pytest.param(None, None, id=id, marks=pytest.mark.skip(reason=reason))


def _missing(requires: Sequence[str]) -> list[str]:
    if not requires:
        return []
    from core.plan.checks import missing_packages  # imports torch: only where a parser needs one

    return missing_packages(requires)


def tool_parser_params(config: pytest.Config) -> list:
    """pytest.param objects (parser name, Case) for every case the options select."""
    registry, parsers, named = named_plugins(config, "tool_parser", "conformance_tool_parser",
                                             "tool-call parser")
    params = []
    for name in named or sorted(parsers):
        caps = parsers[name].caps
        missing = _missing(caps.requires)
        if missing:
            if name in named:
                params.append(_skip(f"{name}-unavailable",
                                    f"{name}: package {missing[0]} is not installed"))
            continue
        for case in CASES:
            if not case.needs or getattr(caps, case.needs):
                params.append(pytest.param(name, case, id=f"{name}-{case.id}"))
            elif name in named:
                params.append(_skip(f"{name}-{case.id}-not-covered",
                                    f"{name} {NEEDS[case.needs]}"))
    return params


def parametrize(metafunc: pytest.Metafunc, known: dict[str, str] | None = None) -> None:
    """Parametrize the suite's test; `known` maps a test id ("hermes-plain-code") to the reason
    it is expected to fail (a strict xfail: it fails the run once it passes)."""
    if metafunc.function.__name__ != "test_tool_parser_conformance":
        return
    params = tool_parser_params(metafunc.config)
    for i, p in enumerate(params):
        if p.id in (known or {}):
            params[i] = pytest.param(*p.values, id=p.id, marks=[*p.marks, pytest.mark.xfail(
                reason=known[p.id], raises=AssertionError, strict=True)])
    metafunc.parametrize("tool_parser_name,tool_parser_case", params)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    parametrize(metafunc)


def test_tool_parser_conformance(tool_parser_name, tool_parser_case, request):
    from core.plan.registry import get_registry

    reg = get_registry().get("tool_parser", tool_parser_name)
    seed = int(request.config.getoption("conformance_seed", default=0) or 0)
    check_case(reg.load()(), reg.caps, tool_parser_case, seed=seed, name=tool_parser_name)


# -- the checks (each raises AssertionError on a failure; tests call them) ------------------------

def check_case(parser: Any, caps: Any, case: Case, seed: int = 0, name: str = "parser") -> None:
    """Run one case on a built parser (its registration's caps)."""
    assert isinstance(parser, ToolParser), (
        f"{name}: the factory built {type(parser).__name__}, which lacks ToolParser's methods "
        "(parse, tools_prompt, format_calls, format_response)")
    if case.kind == "robust":
        check_robust(parser, caps, case.id, seed)
        return
    if case.kind == "prompt":
        check_prompt(parser)
        return
    if case.kind == "deep":
        check_deep(parser)
        return
    built = case.build(parser, caps)
    for sample in built if isinstance(built, list) else [built]:
        {"calls": check_calls, "plain": check_plain, "malformed": check_malformed,
         "unknown": check_unknown}[case.kind](parser, sample)


def _jsonish(v: Any) -> str:
    """JSON-equality key: 1, 1.0 and True differ, key order does not."""
    return json.dumps(v, sort_keys=True, ensure_ascii=False)


def _show(pieces: Sequence[Any]) -> str:
    return "[" + ", ".join(repr(p) if isinstance(p, str) else
                           f"ToolCall({p.name!r}, {p.arguments!r}, complete={p.complete})"
                           for p in pieces) + "]"


def _treq(sample: Sample) -> ToolRequest:
    names = sample.offered or tuple(dict.fromkeys(c["name"] for c in sample.calls)) or ("f",)
    return ToolRequest(tuple({"type": "function", "function": {"name": n}} for n in names),
                       "auto")


def parse(parser: Any, text: str, final: bool) -> list[Any]:
    """parser.parse, with what comes back checked for shape (both modes)."""
    try:
        pieces = parser.parse(text, final)
    except Exception as exc:
        raise AssertionError(f"parse({text!r}, final={final}) raised "
                             f"{type(exc).__name__}: {exc}") from exc
    where = f"parse({text!r}, final={final}) -> {pieces!r}"
    assert isinstance(pieces, list), f"{where}: not a list"
    for i, p in enumerate(pieces):
        if isinstance(p, str):
            continue
        assert isinstance(p, ToolCall), f"{where}: item {i} is neither str nor ToolCall"
        assert p.name is None or (isinstance(p.name, str) and p.name), (
            f"{where}: call {i}'s name must be None (not read yet) or a non-empty string")
        assert isinstance(p.arguments, str) and isinstance(p.raw, str), (
            f"{where}: call {i}'s arguments and raw must be strings")
        assert p.arguments == "" or p.arguments.startswith("{"), (
            f"{where}: call {i}'s arguments {p.arguments[:40]!r} are not the text of an "
            "object (\"\" until it begins)")
        if final:
            assert p.complete, f"{where}: call {i} is incomplete in a final result"
        if p.complete:
            assert p.name is not None, f"{where}: call {i} is complete without a name"
            depth = json_depth(p.arguments)
            assert depth <= MAX_ARGUMENT_DEPTH, (
                f"{where}: call {i}'s arguments nest {depth} levels, deeper than "
                f"MAX_ARGUMENT_DEPTH ({MAX_ARGUMENT_DEPTH}): such a call is not well formed, its "
                "text stays content (core/contract/tools.py)")
            try:
                args = json.loads(p.arguments)
            except ValueError:
                args = None
            assert isinstance(args, dict), (
                f"{where}: complete call {i}'s arguments {p.arguments!r} are not a JSON object")
            if final:
                assert p.raw and p.raw in text, (
                    f"{where}: call {i}'s raw {p.raw!r} is not its text as written")
        else:
            assert i == len(pieces) - 1, f"{where}: incomplete call {i} is not the last item"
    return pieces


def visible(pieces: Sequence[Any]) -> list[Any]:
    """What the core makes of a result, as pieces: empty strings dropped, adjacent ones joined;
    up to a call whose name is not read yet or whose arguments have not begun (held back)."""
    out: list[Any] = []
    for p in pieces:
        if isinstance(p, str):
            if p and out and isinstance(out[-1], str):
                out[-1] += p
            elif p:
                out.append(p)
        elif p.name is None or not (p.complete or p.arguments):
            break
        else:
            out.append(p)
    return out


def content_of(pieces: Sequence[Any]) -> str:
    return "".join(p for p in pieces if isinstance(p, str))


def extends(short: Sequence[Any], long: Sequence[Any]) -> str | None:
    """Why `long` (visible pieces of a longer text) does not extend `short`; None when it does:
    each piece but the last the same, the last grown (content at its end; a call: the same
    name, its arguments and raw grown, complete ones unchanged)."""
    if len(short) > len(long):
        return f"it has {len(long)} pieces after {len(short)}"
    for i, (a, b) in enumerate(zip(short, long, strict=False)):
        last = i == len(short) - 1
        if isinstance(a, str):
            if not isinstance(b, str):
                return f"content {a!r} became a call {b.name!r}"
            if not (b.startswith(a) if last else b == a):
                return f"content {a!r} became {b!r}"
            continue
        if not isinstance(b, ToolCall):
            return f"call {a.name!r} ({a.arguments!r}) became content {b!r}"
        if b.name != a.name:
            return f"call {a.name!r} became a call {b.name!r}"
        if not b.arguments.startswith(a.arguments) or \
                ((a.complete or not last) and b.arguments != a.arguments):
            return f"call {a.name!r}'s arguments {a.arguments!r} became {b.arguments!r}"
        if not b.raw.startswith(a.raw):
            return f"call {a.name!r}'s raw text {a.raw!r} became {b.raw!r}"
    return None


def boundaries(text: str, step: int | str) -> list[int]:
    """Where a stream in chunks of `step` characters (or "tokens") stops before the end."""
    if step == "tokens":
        ends = [m.end() for m in TOKEN.finditer(text)]
    else:
        ends = list(range(int(step), len(text), int(step)))
    return [e for e in ends if 0 < e < len(text)]


def check_stream(parser: Any, text: str, final: list[Any], step: int | str,
                 what: str = "") -> None:
    """parse at every boundary only extends the step before and the final result (whose
    visible content is `final`'s)."""
    want = visible(final)
    prev: list[Any] = []
    prev_at = 0
    for at in [*boundaries(text, step), len(text)]:
        now = visible(parse(parser, text[:at], False))
        leak = content_of(now)
        assert content_of(want).startswith(leak), (
            f"{what}streamed in chunks of {step}: after {text[:at]!r} the content is {leak!r}, "
            f"which is not a start of the final content {content_of(want)!r} (text that is part "
            "of a call, or held back, was streamed as content)")
        why = extends(prev, now)
        assert why is None, (f"{what}streamed in chunks of {step}: from {text[:prev_at]!r} to "
                             f"{text[:at]!r}: {why} ({_show(prev)} -> {_show(now)})")
        why = extends(now, want)
        assert why is None, (f"{what}streamed in chunks of {step}: after {text[:at]!r} "
                             f"{_show(now)}, the final result {_show(want)} does not extend "
                             f"it: {why}")
        prev, prev_at = now, at


def core_stream(parser: Any, treq: ToolRequest, text: str, step: int | str
                ) -> tuple[str, list[tuple[str, str]]]:
    """The core's stream (ToolStream) of `text`: (content, [(name, arguments joined)])."""
    s = ToolStream(parser, treq)
    deltas: list[dict[str, Any]] = []
    for at in boundaries(text, step):
        deltas += s.step(text[:at], False)
    deltas += s.step(text, False)
    deltas += s.step(text, True)
    content, calls = "", []
    for d in deltas:
        content += d.get("content", "")
        for c in d.get("tool_calls", ()):
            if c["index"] == len(calls):
                calls.append([c["function"]["name"], c["function"]["arguments"]])
            else:
                calls[c["index"]][1] += c["function"]["arguments"]
    return content, [tuple(c) for c in calls]


def _final_message(parser: Any, treq: ToolRequest, text: str
                   ) -> tuple[str, list[tuple[str, str]]]:
    msg, _ = final_message(parser, treq, text, "stop")
    return msg["content"] or "", [(c["function"]["name"], c["function"]["arguments"])
                                  for c in msg.get("tool_calls", ())]


def check_core_stream(parser: Any, sample: Sample, calls_must_match: bool = True) -> None:
    """The core's stream of the sample, at every chunking, joins to its final message."""
    treq = _treq(sample)
    content, calls = _final_message(parser, treq, sample.text)
    for step in (*STEPS, "tokens"):
        s_content, s_calls = core_stream(parser, treq, sample.text, step)
        assert s_content == content, (
            f"the core's stream of {sample.text!r} in chunks of {step} sends content "
            f"{s_content!r}, the final message has {content!r}")
        if calls_must_match:
            assert s_calls == calls, (
                f"the core's stream of {sample.text!r} in chunks of {step} sends calls "
                f"{s_calls}, the final message has {calls}")


def _got(pieces: Sequence[Any]) -> list[tuple[str, str]]:
    return [(p.name, _jsonish(json.loads(p.arguments))) for p in pieces
            if isinstance(p, ToolCall)]


def _want(calls: Sequence[dict[str, Any]]) -> list[tuple[str, str]]:
    return [(c["name"], _jsonish(c["arguments"])) for c in calls]


def check_calls(parser: Any, sample: Sample) -> None:
    """The calls the parser wrote (after the sample's content) read back, one-shot, streamed,
    and through the core."""
    text = sample.text
    final = parse(parser, text, True)
    assert _got(final) == _want(sample.calls), (
        f"parse({text!r}, final=True) -> {_show(final)}: not the calls written "
        f"({_want(sample.calls)})")
    for p in final:
        if isinstance(p, ToolCall):
            assert p.name in p.raw, f"call {p.name!r}'s raw text {p.raw!r} lacks its name"
    got = content_of(final).strip()
    assert got == sample.content, (
        f"parse({text!r}, final=True) -> {_show(final)}: content {got!r}, written "
        f"{sample.content!r}")
    content, calls = _final_message(parser, _treq(sample), text)
    assert content == sample.content and [(n, _jsonish(json.loads(a))) for n, a in calls] == \
        _want(sample.calls), f"the core's final message of {text!r}: {content!r}, {calls}"
    for step in (*STEPS, "tokens"):
        check_stream(parser, text, final, step)
    check_core_stream(parser, sample)


def check_plain(parser: Any, sample: Sample) -> None:
    """No call in a plain text: the text back unchanged, streamed or not."""
    text = sample.text
    final = parse(parser, text, True)
    assert not _got(final) and content_of(final) == text, (
        f"parse({text!r}, final=True) -> {_show(final)}: a text with no call must come back "
        "unchanged, as content")
    for step in (*STEPS, "tokens"):
        check_stream(parser, text, final, step)
    check_core_stream(parser, sample)
    content, calls = _final_message(parser, _treq(sample), text)
    assert (content, calls) == (text.strip(), []), (content, calls)


def check_malformed(parser: Any, sample: Sample) -> None:
    """A malformed call is text: verbatim, final; never a call streamed where the arguments are
    visibly not an object; what the core streams joins to the final content."""
    text = sample.text
    final = parse(parser, text, True)
    got = _got(final)
    assert got == _want(sample.calls[:len(got)]), (
        f"parse({text!r}, final=True) -> {_show(final)}: a malformed call was read as a call "
        f"(the well-formed ones before it: {_want(sample.calls)})")
    content = content_of(final)
    if not got:
        assert content == text, (
            f"parse({text!r}, final=True) -> {_show(final)}: with no well-formed call the text "
            "must come back verbatim, as content (core/contract/tools.py)")
    else:
        tail = text.rstrip()[-24:]
        assert content.rstrip().endswith(tail), (
            f"parse({text!r}, final=True) -> {_show(final)}: the malformed call's text "
            f"{tail!r} is not in the content verbatim")
    for step in (*STEPS, "tokens"):  # no crash, well-formed partial results
        for at in boundaries(text, step):
            parse(parser, text[:at], False)
    # arguments visibly not an object: no call is streamed (the final message has none);
    # a truncated call may be, before it breaks: only the content must agree
    check_core_stream(parser, sample, calls_must_match=not sample.truncated)


def check_unknown(parser: Any, sample: Sample) -> None:
    """Calls to functions not offered: the parser reads them (it is not given the tools); the
    core keeps the offered ones and puts the others' raw text back into the content."""
    text = sample.text
    final = parse(parser, text, True)
    assert _got(final) == _want(sample.calls), (
        f"parse({text!r}, final=True) -> {_show(final)}: not the calls written "
        f"({_want(sample.calls)})")
    content, calls = _final_message(parser, _treq(sample), text)
    offered = [c for c in sample.calls if c["name"] in sample.offered]
    assert [(n, _jsonish(json.loads(a))) for n, a in calls] == _want(offered), calls
    for p in final:
        if isinstance(p, ToolCall) and p.name not in sample.offered:
            assert p.raw.strip() in content, (
                f"the core's content {content!r} lacks the raw text {p.raw!r} of the call to "
                f"{p.name!r}, which the request did not offer")
    for step in (*STEPS, "tokens"):
        check_stream(parser, text, final, step)
    check_core_stream(parser, sample)


# robustness: texts made from the parser's own calls and from fragments of markup and JSON
FRAGMENTS = ('{', '}', '[', ']', '"', '\\', ':', ',', ';', ' ', '\n', '<', '>', '/', '|',
             '{"name": ', '"get_weather"', '"arguments": ', '"parameters": ', '{}', 'null',
             '1', '-', '.', 'e', 'é', '🌍', '\x00', '"\\u00', '<tool_call>', '</tool_call>',
             '<|python_tag|>', '<|eot_id|>', '[TOOL_CALLS]', 'text ')


def robust_texts(parser: Any, caps: Any, which: str, seed: int) -> list[str]:
    """The robustness case's texts (deterministic for a seed)."""
    rng = random.Random(f"{seed}-{which}")
    if which == "robust-fragments":
        pool = FRAGMENTS + tuple(caps.markers) + tuple(m[:len(m) // 2] for m in caps.markers)
        return [text for _ in range(120)
                for text in ["".join(rng.choice(pool) for _ in range(rng.randint(1, 14)))]]
    bases = [parser.format_calls([dict(WEATHER)]), "Sure.\n" + parser.format_calls(
        [call("f", a={"b": [1, "x\\\"y"]})])]
    if caps.parallel_calls:
        bases.append(parser.format_calls([dict(TIME), dict(WEATHER)]))
    alphabet = '{}[]":,;\\ \n<>/|ae1' + "".join(caps.markers)
    out = []
    for base in bases:
        for _ in range(40):
            t = base
            for _ in range(rng.randint(1, 3)):
                i = rng.randrange(len(t) + 1)
                j = min(len(t), i + rng.randint(1, 8))
                op = rng.randrange(4)
                if op == 0:  # delete a span
                    t = t[:i] + t[j:]
                elif op == 1:  # insert a character
                    t = t[:i] + rng.choice(alphabet) + t[i:]
                elif op == 2:  # duplicate a span
                    t = t[:j] + t[i:j] + t[j:]
                else:  # cut the text
                    t = t[:i]
            out.append(t)
    return out


def check_robust(parser: Any, caps: Any, which: str, seed: int = 0) -> None:
    """parse never raises and returns well-formed results on any text; with no call the final
    result is the text verbatim; streamed content never has to be taken back."""
    for text in robust_texts(parser, caps, which, seed):
        final = parse(parser, text, True)
        if not _got(final):
            assert content_of(final) == text, (
                f"parse({text!r}, final=True) -> {_show(final)}: with no call the text must "
                "come back verbatim, as content")
        want = content_of(visible(final))
        for step in (1, "tokens"):
            for at in [*boundaries(text, step), len(text)]:
                now = content_of(visible(parse(parser, text[:at], False)))
                assert want.startswith(now), (
                    f"streamed: after {text[:at]!r} the content is {now!r}, which is not a start "
                    f"of the final content {want!r} of {text!r}")
        treq = ToolRequest(({"type": "function", "function": {"name": "get_weather"}},), "auto")
        final_message(parser, treq, text, "stop")


TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather in a city (°C, ünïcödé)",
        "parameters": {"type": "object", "required": ["city"], "properties": {
            "city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}}}}},
    {"type": "function", "function": {"name": "get_time", "description": "The time now"}},
    {"type": "function", "function": {"name": "ns.lookup-v2"}},
]


# tool results format_response must hold verbatim (the model's only view of the result)
RESPONSES = ('{"temp": 21, "sky": "☀"}', "  spaces and\nnewlines at both ends \n\n",
             "unicode: Zürich 東京 🌦️ e\u0301, escapes: \\n \\\" \\u0041 \"quoted\"",
             "markup: <tool_response>x</tool_response> <tool_call> <|python_tag|> <|eot_id|>",
             "", "\ttabs\tand\r\ncarriage returns")


def check_prompt(parser: Any) -> None:
    """tools_prompt: a deterministic string naming every tool; format_response holds each result
    verbatim; format_calls is deterministic."""
    prompt = parser.tools_prompt(TOOLS)
    assert isinstance(prompt, str) and prompt == parser.tools_prompt(TOOLS), \
        "tools_prompt must be a string, the same for the same tools"
    for t in TOOLS:
        assert t["function"]["name"] in prompt, f"the tools prompt lacks {t['function']['name']}"
    for name in ("get_weather", None):
        for content in RESPONSES:
            got = parser.format_response(content, name)
            assert isinstance(got, str) and content in got, (
                f"format_response({content!r}, {name!r}) -> {got!r} does not hold the content "
                "verbatim (core/contract/tools.py: unchanged, as one substring)")
    calls = [dict(WEATHER), dict(TIME)]
    assert parser.format_calls(calls) == parser.format_calls(calls)


DEEP = "DEEP-ARGUMENT-7f3a"  # an argument value replaced by deeply nested arrays


def deep_text(parser: Any, depth: int) -> str:
    """A call written by the parser whose arguments nest `depth` levels ({"deep": [[...]]}),
    written with a placeholder and the nesting put in as text (json.dumps would recurse)."""
    text = parser.format_calls([call("get_weather", deep=DEEP)])
    marker = json.dumps(DEEP)
    assert marker in text, f"format_calls did not write the argument {DEEP!r} as JSON: {text!r}"
    return text.replace(marker, "[" * (depth - 1) + "]" * (depth - 1), 1)


def check_deep(parser: Any) -> None:
    """Arguments nested to MAX_ARGUMENT_DEPTH read back; deeper, parse never raises and the
    text comes back verbatim as content (a call that is not well formed), streamed or not."""
    text = deep_text(parser, MAX_ARGUMENT_DEPTH)
    got = _got(parse(parser, text, True))
    nested: list[Any] = []
    for _ in range(MAX_ARGUMENT_DEPTH - 2):
        nested = [nested]
    assert got == [("get_weather", _jsonish({"deep": nested}))], (
        f"a call whose arguments nest {MAX_ARGUMENT_DEPTH} levels (the limit) -> {got}: not "
        "read back")
    treq = ToolRequest(({"type": "function", "function": {"name": "get_weather"}},), "auto")
    for depth in (MAX_ARGUMENT_DEPTH + 1, 1500, 50_000):
        text = deep_text(parser, depth)
        what = f"a call whose arguments nest {depth} levels"
        final = parse(parser, text, True)
        assert not _got(final) and content_of(final) == text, (
            f"{what} -> {_show(final)[:300]}: deeper than MAX_ARGUMENT_DEPTH "
            f"({MAX_ARGUMENT_DEPTH}) a call is not well formed: the text must come back "
            "verbatim, as content")
        want_content = content_of(visible(final))
        for k in range(1, 11):  # streamed: ten prefixes, then the whole text
            at = len(text) * k // 10
            now = content_of(visible(parse(parser, text[:at], False)))
            assert want_content.startswith(now), (
                f"{what}, streamed: after {at} characters the content {now[-80:]!r} is not a "
                "start of the final content")
        content, calls = _final_message(parser, treq, text)
        assert (content, calls) == (text.strip(), []), (
            f"the core's final message of {what}: {content[:80]!r}, {calls}")
