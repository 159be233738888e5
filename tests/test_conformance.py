"""The attention conformance suite over the built-in backends.

On a CPU machine: torch_native, flex_attention (FlexAttention's eager path runs on CPU) and triton
under TRITON_INTERPRET=1 (Triton >= 3.9; fp16/fp32: the interpreter gets bf16 wrong), small
shapes. On a GPU machine, `pytest -m gpu tests/test_conformance.py --conformance-full` runs the
cuda cases at full size. The suite itself lives in conformance/ (shipped for third-party backends).
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

# Before any Triton kernel module is imported (they are imported lazily by the backend factory):
# without a GPU, Triton kernels run in the interpreter.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from conformance.attention_suite import *  # noqa: E402,F401,F403
from conformance.attention_suite import conformance_params  # noqa: E402
from core.plan.registry import get_registry  # noqa: E402

BUILTIN = ("torch_native", "triton", "flex_attention")


def test_builtin_backends_are_registered():
    """A stale install (entry points from an older pyproject) would silently shrink the suite."""
    registered = set(get_registry().kind("attention"))
    missing = [n for n in BUILTIN if n not in registered]
    assert not missing, (f"attention backends {missing} not registered: reinstall core-serve "
                         f"(pip install --no-deps -e .) so its entry points are current")


def test_suite_covers_every_builtin_backend_on_cpu(request):
    """Each built-in backend gets cases on CPU (triton through the interpreter), with both
    phases, GQA ratios 1/4/8, head dims 64/128 and page sizes 1/16/64."""
    if request.config.getoption("conformance_backend", default=None):
        pytest.skip("--conformance-backend narrows the suite on purpose")
    params = [p.values[0] for p in conformance_params(request.config)
              if p.values[0] is not None and p.values[0].device == "cpu"]
    interpreted = (os.environ.get("TRITON_INTERPRET", "") not in ("", "0")
                   and importlib.util.find_spec("triton") is not None)
    for name in BUILTIN if interpreted else ("torch_native", "flex_attention"):
        cases = [p.case for p in params if p.backend.name == name]
        assert {c.mode for c in cases} == {"decode", "extend"}, name
        assert {c.group for c in cases} == {1, 4, 8}, name
        assert {64, 128} <= {c.head_dim for c in cases}, name
        assert {c.page_size for c in cases} == {1, 16, 64}, name
    if interpreted:
        triton_dtypes = {p.case.dtype for p in params if p.backend.name == "triton"}
        assert triton_dtypes == {"float16", "float32"}
