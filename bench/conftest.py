"""Benchmarks are collected from bench_*.py (run `pytest bench/`); they are never run as tests."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

# Shared helpers (the HF reference model) live with the tests.
TESTS_DIR = Path(__file__).resolve().parent.parent / "tests"
if str(TESTS_DIR) not in sys.path:
    sys.path.insert(0, str(TESTS_DIR))


def pytest_collect_file(file_path, parent):
    # A file named on the command line is collected by pytest itself; a folder needs this.
    if (file_path.suffix == ".py" and file_path.name.startswith("bench_")
            and not parent.session.isinitpath(file_path)):
        return pytest.Module.from_parent(parent, path=file_path)
    return None
