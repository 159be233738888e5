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
