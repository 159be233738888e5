"""bench/sass_count.py: a Triton kernel compiled for sm_90 on this GPU-less machine, and its
SASS counted. An IEEE division shows as an FCHK (its fast path's range check, beside a
MUFU.RCP and a CALL of the shared slow path): one per element for a division per element, one
in all for the reciprocal form the quant kernels use (core.quant.reciprocal)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")


@triton.jit
def _per_element_div(x_ptr, s_ptr, y_ptr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    s = tl.load(s_ptr + offs)
    tl.store(y_ptr + offs, tl.math.div_rn(tl.load(x_ptr + offs), s))


@triton.jit
def _one_reciprocal(x_ptr, s_ptr, y_ptr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    s = tl.load(s_ptr)
    tl.store(y_ptr + offs, tl.load(x_ptr + offs) * tl.math.div_rn(s * 0.0 + 1.0, s))


def test_sass_counts_show_where_the_divisions_are():
    nvdisasm = Path(triton.__file__).parent / "backends/nvidia/bin/nvdisasm"
    if not nvdisasm.exists() or os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("this triton has no bundled CUDA backend tools")
    from sass_count import count

    per, _ = count(_per_element_div, {"BLOCK": 256}, {}, warps=1, stages=1)
    once, text = count(_one_reciprocal, {"BLOCK": 256}, {}, warps=1, stages=1)
    assert once["FCHK"] == 1, text
    assert per["FCHK"] == 8  # 256 elements over 32 threads: 8 divisions each
    assert sum(per.values()) > 1.5 * sum(once.values())
