"""The reasoning-parser conformance tests (core/contract/reasoning.py): what a parser writes
(its `format`) reads back exactly, whole and streamed in any chunks, with no marker in any
delta; text without markers left whole; no crash and no disagreement on any input.

Collected by the conformance plugin (`pytest --conformance-reasoning-parser NAME -rs`, see
conformance.plugin), or by importing them into a test module:

    from conformance.reasoning_parser_suite import *  # noqa: F401,F403

Parametrization: every registered reasoning parser whose packages are installed (or only those
named; a named one that cannot run is one skip with the reason) x every case (CASES). Chunk
boundaries are random, seeded by --conformance-seed (default 0), so a failure repeats.

The checks, as core/contract/reasoning.py states them, each from both starting states
(in_reasoning false and true: the core may start either way):
- round trip: for reasoning / content pairs (prose, empty parts, whitespace and newlines at
  the ends, unicode: accents, CJK, right-to-left, emoji with joiners and skin tones, combining
  marks; every declared marker cut short at either end, angle brackets and pipes),
  split(format(r, c, s), s) == (r, c): nothing lost, nothing added.
- streaming: the same texts fed in pieces of 1 character, at every 2-split, and in random
  chunks: the deltas join to split's parts; no delta holds a marker (ReasoningParserCaps.reads);
  whenever the text fed so far does not end with the start of a marker, everything is out
  (the stream held back only what could be the start of a marker).
- plain text (no marker, only partial ones): split gives it all as content, or all as
  reasoning when starting in reasoning (the caps' starts_in_reasoning: the model may begin
  there); streamed the same.
- the prompt: a prompt that ends opening the reasoning (format's text up to where the
  reasoning goes) leaves the model in reasoning (prompt_in_reasoning); a prompt holding a
  whole reasoning block, or none, does not.
- robustness: random strings of markers, their pieces and text: split and the stream never
  raise and always agree (a marker where the format has none, a close marker before any
  reasoning, may stay in its part as text).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

from conformance.plugin import named_plugins
from core.contract.capabilities import ReasoningParserCaps
from core.contract.reasoning import ReasoningParser, longest_hold

__all__ = ["pytest_generate_tests", "test_reasoning_parser_conformance"]

SENTINEL = "\x00reasoning-goes-here\x00"


@dataclass(frozen=True)
class Case:
    id: str
    kind: str  # roundtrip | stream | plain | prompt | robust


CASES = (Case("roundtrip", "roundtrip"), Case("stream", "stream"), Case("plain", "plain"),
         Case("prompt", "prompt"), Case("robust", "robust"))

PROSE = ("The user asks for 2 + 2. That is 4.", "Four.")
UNICODE = ("Ça coûte 5 €; 日本語のテキスト; مرحبا بالعالم; 👩‍👩‍👧‍👦 👍🏽; e\u0301",
           "Réponse : 4 ✓ — 🎉\u200d")


def samples(caps: ReasoningParserCaps) -> list[tuple[str, str]]:
    """(reasoning, content) pairs: prose, edges, unicode, partial markers."""
    out = [PROSE, UNICODE, ("", "Only an answer."), ("Only reasoning.", ""), ("", ""),
           ("\n  spaced \n\n", "\n\n  answer  \n"), ("a\r\nb\tc\x00d", "<>|<<||>>"),
           ("x" * 300, "y" * 300)]
    for m in caps.reads:
        if len(m) > 1:  # a marker cut short, at the end and at the start of each part
            out.append((f"before {m[:-1]}", f"{m[1:]} after"))
            out.append((f"{m[1:]} then", f"then {m[:-1]}"))
    return out


def _parts_of(stream_out: list[tuple[str, str]]) -> tuple[str, str]:
    return "".join(r for r, _ in stream_out), "".join(c for _, c in stream_out)


def _run_stream(parser: ReasoningParser, caps: ReasoningParserCaps, text: str,
                cuts: list[int], start: bool, where: str, markers: bool = True
                ) -> tuple[str, str]:
    """Feed `text` cut at `cuts`; check the hold-back rule and (markers: the text is well
    formed) that no delta holds a marker; the joined parts."""
    stream = parser.stream(start)
    got: list[tuple[str, str]] = []
    prev = 0
    for cut in [*cuts, len(text)]:
        got.append(stream.feed(text[prev:cut]))
        prev = cut
        fed = text[:cut]
        if longest_hold(fed, caps.reads) == 0:
            assert _parts_of(got) == parser.split(fed, start), (
                f"{where}: after {fed!r} the stream gave {_parts_of(got)!r}, but nothing there "
                f"can start a marker, so it should have given split's {parser.split(fed, start)!r}")
    got.append(stream.finish())
    for r, c in got if markers else ():
        for m in caps.reads:
            assert m not in r and m not in c, f"{where}: a delta holds the marker {m!r}: {(r, c)!r}"
    return _parts_of(got)


def _chunkings(text: str, rng: random.Random) -> list[list[int]]:
    n = len(text)
    out = [list(range(1, n))]  # a character at a time
    out += [[k] for k in range(1, n)] if n <= 200 else []  # every split in two
    for _ in range(12):
        k = rng.randint(0, max(0, min(n - 1, 40)))
        out.append(sorted(rng.sample(range(1, n), k)) if n > 1 else [])
    return out


def check_roundtrip(parser: ReasoningParser, caps: ReasoningParserCaps) -> None:
    for start in (False, True):
        for r, c in samples(caps):
            text = parser.format(r, c, start)
            assert parser.split(text, start) == (r, c), (
                f"split(format({r!r}, {c!r}, {start}), {start}) gave "
                f"{parser.split(text, start)!r}; the text was {text!r}")


def check_stream(parser: ReasoningParser, caps: ReasoningParserCaps, seed: int) -> None:
    rng = random.Random(seed)
    for start in (False, True):
        for r, c in samples(caps):
            text = parser.format(r, c, start)
            for cuts in _chunkings(text, rng):
                where = f"{text!r} from in_reasoning={start}, cut at {cuts}"
                assert _run_stream(parser, caps, text, cuts, start, where) == (r, c), where


def check_plain(parser: ReasoningParser, caps: ReasoningParserCaps, seed: int) -> None:
    rng = random.Random(seed)
    partial = [m[:-1] for m in caps.reads if len(m) > 1]
    texts = [*PROSE, *UNICODE, "", "  \n", "<", "a < b > c | d", *partial,
             " ".join(partial) + " end"]
    start = caps.starts_in_reasoning
    for text in texts:
        if any(m in text for m in caps.reads):
            continue
        want = (text, "") if start else ("", text)
        assert parser.split(text, start) == want, (
            f"{text!r} holds no marker: split(text, {start}) should be {want!r}, got "
            f"{parser.split(text, start)!r}")
        for cuts in _chunkings(text, rng)[:6]:
            where = f"plain {text!r} cut at {cuts}"
            assert _run_stream(parser, caps, text, cuts, start, where) == want, where


def check_prompt(parser: ReasoningParser, caps: ReasoningParserCaps) -> None:
    written = parser.format(SENTINEL, "", False)
    opening = written[:written.index(SENTINEL)]
    head = "<|user|>What is 2 + 2?\n<|assistant|>"
    assert parser.prompt_in_reasoning(head + opening), (
        f"a prompt ending {opening!r} (how this parser's format opens the reasoning) should "
        "leave the model in reasoning")
    assert parser.prompt_in_reasoning(head + opening + "\n"), "a newline after the opening"
    closed = parser.format("thought", "answer", False)
    assert not parser.prompt_in_reasoning(head + closed), (
        f"a prompt holding a whole block ({closed!r}) leaves the model outside reasoning")
    assert not parser.prompt_in_reasoning(head), "a prompt with no marker"


def check_robust(parser: ReasoningParser, caps: ReasoningParserCaps, seed: int) -> None:
    rng = random.Random(seed)
    atoms = [*caps.reads, *(m[:k] for m in caps.reads for k in range(1, len(m))),
             *(m[k:] for m in caps.reads for k in range(1, len(m))),
             "a", " ", "\n", "é", "👍🏽", "<", ">", "|", "analysis", "final", "assistant"]
    for _ in range(300):
        text = "".join(rng.choice(atoms) for _ in range(rng.randint(0, 12)))
        for start in (False, True):
            want = parser.split(text, start)
            assert isinstance(want, tuple) and all(isinstance(p, str) for p in want)
            cuts = sorted(rng.sample(range(1, len(text)), rng.randint(0, len(text) - 1))) \
                if len(text) > 1 else []
            where = f"{text!r} from in_reasoning={start}, cut at {cuts}"
            assert _run_stream(parser, caps, text, cuts, start, where, False) == want, where


def check_case(parser: object, caps: ReasoningParserCaps, case: Case, seed: int = 0,
               name: str = "parser") -> None:
    """Run one case on a built parser (its registration's caps)."""
    assert isinstance(parser, ReasoningParser), (
        f"{name}: the factory built {type(parser).__name__}, which lacks ReasoningParser's "
        "methods (prompt_in_reasoning, split, stream, format)")
    if case.kind == "roundtrip":
        check_roundtrip(parser, caps)
    elif case.kind == "stream":
        check_stream(parser, caps, seed)
    elif case.kind == "plain":
        check_plain(parser, caps, seed)
    elif case.kind == "prompt":
        check_prompt(parser, caps)
    else:
        check_robust(parser, caps, seed)


def _skip(id: str, reason: str):
    return pytest.param(None, None, id=id, marks=pytest.mark.skip(reason=reason))


def reasoning_parser_params(config: pytest.Config) -> list:
    """pytest.param objects (parser name, Case) for every case the options select."""
    _, parsers, named = named_plugins(config, "reasoning_parser",
                                      "conformance_reasoning_parser", "reasoning parser")
    params = []
    for name in named or sorted(parsers):
        requires = parsers[name].caps.requires
        if requires:
            from core.plan.checks import missing_packages

            missing = missing_packages(requires)
            if missing:
                if name in named:
                    params.append(_skip(f"{name}-unavailable",
                                        f"{name}: package {missing[0]} is not installed"))
                continue
        params += [pytest.param(name, case, id=f"{name}-{case.id}") for case in CASES]
    return params


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if metafunc.function.__name__ != "test_reasoning_parser_conformance":
        return
    metafunc.parametrize("reasoning_parser_name,reasoning_parser_case",
                         reasoning_parser_params(metafunc.config))


def test_reasoning_parser_conformance(reasoning_parser_name, reasoning_parser_case, request):
    from core.plan.registry import get_registry

    reg = get_registry().get("reasoning_parser", reasoning_parser_name)
    seed = int(request.config.getoption("conformance_seed", default=0) or 0)
    check_case(reg.load()(), reg.caps, reasoning_parser_case, seed=seed,
               name=reasoning_parser_name)
