"""The README's quick start and CI must not drift apart."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _quick_start_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    block = re.search(r"## Quick start.*?```bash\n(.*?)```", text, re.S)
    assert block, "README has no bash block under '## Quick start'"
    return [ln.strip() for ln in block.group(1).splitlines()
            if ln.strip() and not ln.strip().startswith("#")]


def test_quick_start_is_two_commands():
    cmds = _quick_start_commands()
    assert len(cmds) == 2, cmds
    assert cmds[0].endswith("core serve")
    assert "pytest" in cmds[1]


def test_ci_runs_the_readme_test_command():
    test_cmd = _quick_start_commands()[1]
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert test_cmd in [ln.strip() for ln in ci], ".ci/run must run the README's test command"


def _readme() -> str:
    return (ROOT / "README.md").read_text()


def _toml_lists(table: str) -> dict:
    """`key = [...]` lists and `key = "..."` strings of one pyproject.toml table (no tomllib:
    Python 3.10 lacks it)."""
    import ast

    text = (ROOT / "pyproject.toml").read_text()
    body = re.search(rf"^\[(?:project\.)?{re.escape(table)}\]\n(.*?)(?=^\[|\Z)", text,
                     re.S | re.M).group(1)
    body = re.sub(r"#[^\n\"']*$", "", body, flags=re.M)  # comments outside strings
    out = {}
    for m in re.finditer(r'^([\w-]+) = (\[.*?\]|"[^\n]*")\s*$', body, re.S | re.M):
        out[m.group(1)] = ast.literal_eval(m.group(2).replace("\n", " "))
    return out


def test_the_curl_example_is_bounded_and_the_defaults_are_said():
    """Issue 32: the example had no max_tokens and sampled at temperature 1, so a second
    identical request rambled toward the 8,192-token context for minutes."""
    text = _readme()
    curl = re.search(r"```bash\n(curl .*?)```", text, re.S)
    assert curl, "README has no curl example"
    assert re.search(r'"max_tokens": \d+', curl.group(1)), curl.group(1)
    for default in ("`temperature` 1", "`max_tokens` in `/v1/chat/completions`: the rest of the",
                    "16 in\n`/v1/completions`", "`max_new_tokens` 128 in `/generate`"):
        assert default in text, default
    from core.engine.sampling import SamplingParams
    from core.server.generation import DEFAULT_MAX_NEW

    assert SamplingParams().temperature == 1.0 and SamplingParams().top_p == 1.0
    assert DEFAULT_MAX_NEW == {"completions": 16, "chat": None, "generate": 128}


def test_the_grammar_extra_is_named_where_structured_output_is_off():
    """The quick start installs the `numba` extra, which holds no grammar library: the README
    and the 400 name the `grammar` extra that pyproject.toml defines."""
    extras = _toml_lists("optional-dependencies")
    assert {"xgrammar", "llguidance", "outlines-core"} <= {
        re.split(r"[<>=;\[ ]", d)[0] for d in extras["grammar"]}
    serve = _quick_start_commands()[0]
    assert "[numba]" in serve and "grammar" not in serve
    assert not any(d.startswith(("xgrammar", "llguidance", "outlines")) for d in extras["numba"])
    text = _readme()
    assert "pip install -e '.[grammar]'" in text and "core-serve[grammar]" in text

    from core.contract.grammar import Constraint
    from core.frontend.request_checks import GRAMMAR_EXTRA_HINT, RequestChecks

    assert "pip install 'core-serve[grammar]'" in GRAMMAR_EXTRA_HINT
    assert "pip install -e '.[grammar]'" in GRAMMAR_EXTRA_HINT

    class Plan:
        grammar_backend = None
        notes = ("structured output off: no grammar backend fits (xgrammar: package xgrammar "
                 "is not installed)",)

    try:
        RequestChecks(Plan(), tokenizer=None).check_constraint(
            Constraint("json_object", source="response_format"), info=None)
    except ValueError as exc:
        assert str(exc).startswith("response_format: structured output is off in this server")
        assert GRAMMAR_EXTRA_HINT in str(exc), str(exc)
    else:
        raise AssertionError("a constraint with structured output off was not refused")
    Plan.notes = ("structured output off: --grammar-backend none",)
    try:  # turned off on purpose: no install hint
        RequestChecks(Plan(), tokenizer=None).check_constraint(
            Constraint("json_object", source="response_format"), info=None)
    except ValueError as exc:
        assert "pip install" not in str(exc) and "(--grammar-backend none)" in str(exc)


def test_the_readme_names_the_default_model_path_and_how_to_run_every_test():
    text = _readme()
    from core.plan.default_model import DEFAULT_MODEL_FILE, DEFAULT_MODEL_PACKAGE

    assert DEFAULT_MODEL_FILE in text and DEFAULT_MODEL_PACKAGE in text
    assert "pytest -m 'not gpu'" in text and "`slow`" in text
    pytest_ini = _toml_lists("tool.pytest.ini_options")
    assert "not slow" in pytest_ini["addopts"] and "not gpu" in pytest_ini["addopts"]
    assert any(m.startswith("slow:") for m in pytest_ini["markers"])
