"""Run a Python script in a fresh interpreter with TRITON_INTERPRET=1: the Triton kernel tests
whose kernels must be interpreted whatever this process has already imported."""

from __future__ import annotations

import os
import subprocess
import sys


def run_interpreted(script: str, timeout: float = 600) -> None:
    """Assert the script exits 0 and prints "ok" (its stderr tail is the failure message)."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                         timeout=timeout)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-3000:]
