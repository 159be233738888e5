"""The tool-call-parser conformance suite (conformance/tool_parser_suite.py) over every
registered parser (hermes, llama3 and gpt-oss built in), shown to fail parsers that are wrong,
and run the way a third-party package runs it: `pytest --conformance-tool-parser NAME -rs` in its own
folder, the parser found through its entry point."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest
from installed_plugin import child_env, install

from conformance import tool_parser_suite as suite
from conformance.tool_parser_suite import *  # noqa: F401,F403 - the suite, over every parser
from conformance.tool_parser_suite import CASES, check_case
from core.contract.capabilities import ToolParserCaps
from core.contract.tools import ToolCall
from core.plan.registry import get_registry

BUILT_IN = ("hermes", "llama3", "gpt-oss")


def test_built_in_parsers_are_registered_and_every_case_is_collected():
    parsers = get_registry().kind("tool_parser")
    assert set(BUILT_IN) <= set(parsers), sorted(parsers)
    unnamed = types.SimpleNamespace(getoption=lambda name, default=None: None)  # no option
    ids = {p.id for p in suite.tool_parser_params(unnamed)}
    for name in BUILT_IN:  # each declares everything (gpt-oss: but prompts)
        needs = {"prompts"} if name == "gpt-oss" else set()
        assert {f"{name}-{c.id}" for c in CASES if c.needs not in needs} <= ids, name
    kinds = {c.kind for c in CASES}
    assert kinds == {"calls", "plain", "malformed", "unknown", "deep", "robust", "prompt"}


def test_a_named_parser_lists_what_its_caps_do_not_declare(monkeypatch):
    one = ToolParserCaps(markers=("<x>",), parallel_calls=False, prompts=False)
    reg = types.SimpleNamespace(caps=one)
    registry = types.SimpleNamespace(kind=lambda kind: {"one": reg, "hermes": reg})
    config = types.SimpleNamespace(getoption=lambda name, default=None: ["one, hermes", "one"]
                                   if name == "conformance_tool_parser" else default)
    monkeypatch.setattr("core.plan.registry.get_registry", lambda: registry)
    params = suite.tool_parser_params(config)
    skipped = {p.id: p.marks[0].kwargs["reason"] for p in params if p.marks}
    needs = {c.id for c in CASES if c.needs}
    assert set(skipped) == {f"{n}-{c}-not-covered" for n in ("one", "hermes") for c in needs}
    assert skipped["one-several-calls-not-covered"] == \
        "one does not declare parallel_calls (one call per answer)"
    assert skipped["one-tools-prompt-not-covered"] == \
        "one does not declare prompts (no tools prompt)"
    ran = [p.id for p in params if not p.marks]
    assert ran[0].startswith("one-") and len(ran) == 2 * (len(CASES) - len(needs))


# -- wrong parsers fail it ------------------------------------------------------------------------

def _hermes():
    return get_registry().get("tool_parser", "hermes").load()()


class _Wrap:
    """hermes, with one thing done wrong (subclasses override parse)."""

    def __init__(self):
        self.inner = _hermes()

    def parse(self, text, final):
        return self.inner.parse(text, final)

    def tools_prompt(self, tools):
        return self.inner.tools_prompt(tools)

    def format_calls(self, calls):
        return self.inner.format_calls(calls)

    def format_response(self, content, name):
        return self.inner.format_response(content, name)


class Leaky(_Wrap):
    """Streams the start of `<tool_call>` as content instead of holding it back."""

    def parse(self, text, final):
        if not final and "<tool_call>" not in text:
            return [text]
        return self.inner.parse(text, final)


class MarkupInContent(_Wrap):
    """Leaves the tags of a call in the content."""

    def parse(self, text, final):
        out = self.inner.parse(text, final)
        return [x for p in out for x in ((p,) if isinstance(p, str) else ("<tool_call>", p))]


class ObjectlessArguments(_Wrap):
    """Takes arguments that are not an object as the call's arguments."""

    def parse(self, text, final):
        m = re.search(r'<tool_call>\s*(\{"name": "(\w+)", "arguments": (.*)\})\s*</tool_call>',
                      text)
        if m and not m.group(3).startswith("{"):
            return [text[:m.start()], ToolCall(m.group(2), m.group(3), m.group(0))]
        return self.inner.parse(text, final)


class DropsMalformed(_Wrap):
    """Drops a block it cannot read instead of keeping it as content."""

    def parse(self, text, final):
        return [p for p in self.inner.parse(text, final)
                if not (final and isinstance(p, str) and p.startswith("<tool_call>"))]


class Reformats(_Wrap):
    """Rewrites the arguments once complete (compact JSON): streamed fragments no longer join
    to the final string."""

    def parse(self, text, final):
        return [ToolCall(p.name, json.dumps(json.loads(p.arguments), separators=(",", ":")),
                         p.raw, True) if isinstance(p, ToolCall) and p.complete else p
                for p in self.inner.parse(text, final)]


class DropsContent(_Wrap):
    """Loses the text before a call."""

    def parse(self, text, final):
        out = self.inner.parse(text, final)
        if any(isinstance(p, ToolCall) for p in out):
            return [p for p in out if not isinstance(p, str)]
        return out


class Crashes(_Wrap):
    """Raises on empty or odd input."""

    def parse(self, text, final):
        if not text.strip() or "\x00" in text:
            raise IndexError("string index out of range")
        return self.inner.parse(text, final)


class NoDepthLimit(_Wrap):
    """Reads a block's JSON with json.loads whatever its depth (as hermes and llama3 did:
    RecursionError past ~1,000 levels, a call past MAX_ARGUMENT_DEPTH below that)."""

    def parse(self, text, final):
        m = re.search(r"<tool_call>\s*(\{.*\})\s*</tool_call>", text, re.S)
        if m:
            obj = json.loads(m.group(1))
            if isinstance(obj, dict) and isinstance(obj.get("arguments"), dict):
                args = m.group(1)[m.group(1).index("{", 1):-1]
                return [text[:m.start()], ToolCall(obj["name"], args, m.group(0)),
                        text[m.end():]]
        return self.inner.parse(text, final)


class Verbose(_Wrap):
    """Trims and escapes the tool result it writes back (format_response must hold it
    verbatim)."""

    def format_response(self, content, name):
        return f"<tool_response>{json.dumps(content.strip())}</tool_response>"


def _failures(parser, only: set[str] | None = None) -> dict[str, str]:
    caps = get_registry().get("tool_parser", "hermes").caps
    out = {}
    for case in CASES:
        if only is not None and case.id not in only:
            continue
        try:
            check_case(parser, caps, case)
        except AssertionError as exc:
            out[case.id] = str(exc)
    return out


@pytest.mark.parametrize("wrong,fails,says", [
    (Leaky, {"one-call", "content-before", "unicode-content-before", "plain-markers"},
     "was streamed as content"),
    (MarkupInContent, {"one-call", "several-calls", "content-before"}, "content '<tool_call>'"),
    (ObjectlessArguments, {"malformed-arguments-string", "malformed-arguments-array",
                           "malformed-arguments-number", "malformed-arguments-null"},
     "are not the text of an object"),
    (DropsMalformed, {"malformed-truncated-in-value", "malformed-after-a-call",
                      "malformed-arguments-string"}, "verbatim"),
    (Reformats, {"one-call", "arguments-nested", "several-calls"}, "arguments"),
    (DropsContent, {"content-before", "unicode-content-before"}, "content ''"),
    (Crashes, {"plain-empty", "plain-whitespace-only", "plain-special-characters",
               "robust-fragments"}, "raised IndexError"),
    (NoDepthLimit, {"deep-arguments"}, "deeper than MAX_ARGUMENT_DEPTH"),
    (Verbose, {"tools-prompt"}, "verbatim"),
])
def test_the_suite_fails_a_wrong_parser(wrong, fails, says):
    untouched = {"plain-prose", "tools-prompt"} - fails
    got = _failures(wrong(), fails | untouched)
    assert fails <= set(got), sorted(got)
    assert any(says in got[c] for c in fails), {c: got[c][:300] for c in fails}
    assert not untouched & set(got), got  # nothing else is failed


def test_the_suite_passes_the_unchanged_wrapper():
    assert _failures(_Wrap()) == {}


# -- run by a third-party package -----------------------------------------------------------------

PACKAGE = '''
"""A third-party tool-call parser package (test fixture): a one-call format (hermes' text,
declared parallel_calls=False, no prompts) and a leaky one."""
from core.contract.capabilities import ToolParserCaps
from core.contract.hookspecs import hookimpl
from plugins.tool_parsers.hermes import HermesToolParser

CORE_PLUGIN_API = ">=1.5,<2"


class Leaky(HermesToolParser):
    def parse(self, text, final):
        return [text] if not final and "<tool_call>" not in text else super().parse(text, final)


@hookimpl
def core_register_tool_parsers(register):
    register("tp_one", ToolParserCaps(markers=("<one>",), parallel_calls=False), HermesToolParser)
    register("tp_leaky", ToolParserCaps(markers=("<leaky>",), prompts=True), Leaky)
'''


@pytest.fixture(scope="module")
def third_party(tmp_path_factory) -> Path:
    """A folder holding the package and its dist-info (as `pip install --target` leaves it),
    and an empty project folder to run pytest in."""
    root = tmp_path_factory.mktemp("tp")
    install(root / "site", "tp_parsers", PACKAGE)
    (root / "project").mkdir()
    return root


def test_a_third_party_parser_runs_the_suite_from_its_folder(third_party):
    env = child_env(third_party / "site")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-v", "-rs", "-p", "no:cacheprovider",
         "--conformance-tool-parser", "tp_one,tp_leaky", "--conformance-tool-parser", "tp_one"],
        cwd=third_party / "project", env=env, capture_output=True, text=True, timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out  # tp_leaky fails
    results = dict(re.findall(r"test_tool_parser_conformance\[([^\]]+)\] (PASSED|FAILED|SKIPPED)",
                              proc.stdout))
    by = {n: {k[len(n) + 1:]: v for k, v in results.items() if k.startswith(n + "-")}
          for n in ("tp_one", "tp_leaky")}
    assert len(results) == 2 * len(CASES), out  # named twice, run once; nothing else collected
    needs = {c.id for c in CASES if c.needs}
    assert {k for k, v in by["tp_one"].items() if v == "SKIPPED"} == \
        {f"{c}-not-covered" for c in needs}, by["tp_one"]
    assert {v for k, v in by["tp_one"].items() if v != "SKIPPED"} == {"PASSED"}, out
    assert "tp_one does not declare parallel_calls (one call per answer)" in out
    assert "tp_one does not declare prompts (no tools prompt)" in out
    assert by["tp_leaky"]["content-before"] == "FAILED", by["tp_leaky"]
    assert by["tp_leaky"]["plain-prose"] == by["tp_leaky"]["tools-prompt"] == "PASSED"
    assert "was streamed as content" in out
