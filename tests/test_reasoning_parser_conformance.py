"""The reasoning-parser conformance suite (conformance/reasoning_parser_suite.py) over every
registered parser (deepseek-r1, qwen3 and gpt-oss built in), shown to fail parsers that are
wrong, and run the way a third-party package runs it: `pytest --conformance-reasoning-parser
NAME -rs`."""

from __future__ import annotations

import subprocess
import sys
import types

import pytest

from conformance import reasoning_parser_suite as suite
from conformance.reasoning_parser_suite import *  # noqa: F401,F403 - the suite, over every parser
from conformance.reasoning_parser_suite import CASES, check_case
from core.contract.reasoning import ThinkParser
from core.plan.registry import get_registry

BUILT_IN = ("deepseek-r1", "gpt-oss", "qwen3")


def test_built_in_parsers_are_registered_and_every_case_is_collected():
    parsers = get_registry().kind("reasoning_parser")
    assert set(BUILT_IN) <= set(parsers), sorted(parsers)
    unnamed = types.SimpleNamespace(getoption=lambda name, default=None: None)
    ids = {p.id for p in suite.reasoning_parser_params(unnamed)}
    assert {f"{n}-{c.id}" for n in BUILT_IN for c in CASES} <= ids


class _LeaksMarker(ThinkParser):
    """Keeps the close marker in the content."""

    def split(self, text, in_reasoning):
        r, c = super().split(text, in_reasoning)
        return r, (self.CLOSE + c) if self.CLOSE in text else c


class _HoldsEverything(ThinkParser):
    """Streams nothing until the end (right parts, but it holds back more than a marker)."""

    def stream(self, in_reasoning):
        parser, buf = self, []

        class S:
            def feed(self, piece):
                buf.append(piece)
                return "", ""

            def finish(self):
                return parser.split("".join(buf), in_reasoning)

        return S()


class _LosesUnicode(ThinkParser):
    def split(self, text, in_reasoning):
        r, c = super().split(text, in_reasoning)
        return r.encode("ascii", "ignore").decode(), c


class _BadStream(ThinkParser):
    """Streams a marker cut in two as text."""

    def stream(self, in_reasoning):
        parser = self

        class S:
            state = in_reasoning

            def feed(self, piece):
                return parser.split(piece, self.state)

            def finish(self):
                return "", ""

        return S()


@pytest.mark.parametrize("bad,case", [(_LeaksMarker, "roundtrip"), (_HoldsEverything, "stream"),
                                      (_LosesUnicode, "roundtrip"), (_BadStream, "stream"),
                                      (_BadStream, "robust")])
def test_wrong_parsers_fail_the_suite(bad, case):
    caps = get_registry().get("reasoning_parser", "qwen3").caps
    with pytest.raises(AssertionError):
        check_case(bad(), caps, next(c for c in CASES if c.id == case))


def test_a_third_party_runs_it_by_name(tmp_path):
    """The option as a plugin package's CI gives it (the plugin loads through its pytest11
    entry point; here with -p, as the package is installed editable in this tree)."""
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "conformance.plugin",
                           "--conformance-reasoning-parser", "gpt-oss", "--conformance-seed",
                           "3", "-rs", "--rootdir", str(tmp_path), str(tmp_path)],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"{len(CASES)} passed" in proc.stdout, proc.stdout
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "conformance.plugin",
                           "--conformance-reasoning-parser", "nope", str(tmp_path)],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode != 0 and "nope not registered" in proc.stdout + proc.stderr
