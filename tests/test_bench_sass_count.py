"""bench/sass_count.py: a Triton kernel compiled for sm_90 on this GPU-less machine, and its
SASS counted. An IEEE division shows as an FCHK (its fast path's range check, beside a
MUFU.RCP and a CALL of the shared slow path): one per element for a division per element, one
in all for the reciprocal form the quant kernels use (core.contract.quant.reciprocal). A row gather with
a runtime stride vectorizes only when the stride and the pointers are compiled as multiples of
16 (--div16), as the GPU launcher compiles them for round values.

It runs in a subprocess without TRITON_INTERPRET (the suite sets it for the kernel tests, and
interpreted kernels cannot be compiled)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"

_SCRIPT = textwrap.dedent("""
    import sys
    from pathlib import Path
    import triton
    import triton.language as tl
    if not (Path(triton.__file__).parent / "backends/nvidia/bin/nvdisasm").exists():
        print("no-tools"); sys.exit(0)
    from sass_count import count

    @triton.jit
    def per_element_div(x_ptr, s_ptr, y_ptr, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        s = tl.load(s_ptr + offs)
        tl.store(y_ptr + offs, tl.math.div_rn(tl.load(x_ptr + offs), s))

    @triton.jit
    def one_reciprocal(x_ptr, s_ptr, y_ptr, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        s = tl.load(s_ptr)
        tl.store(y_ptr + offs, tl.load(x_ptr + offs) * tl.math.div_rn(s * 0.0 + 1.0, s))

    per, _ = count(per_element_div, {"BLOCK": 256}, {}, warps=1, stages=1)
    once, text = count(one_reciprocal, {"BLOCK": 256}, {}, warps=1, stages=1)
    assert once["FCHK"] == 1, text
    assert per["FCHK"] == 8, per  # 256 elements over 32 threads: 8 divisions each
    assert sum(per.values()) > 1.5 * sum(once.values()), (per, once)

    @triton.jit
    def row_gather(X, rows, y_ptr, stride, D: tl.constexpr, R: tl.constexpr):
        r = tl.load(rows + tl.arange(0, R))
        v = tl.load(X + r[:, None] * stride + tl.arange(0, D)[None, :])
        tl.store(y_ptr + tl.arange(0, R)[:, None] * D + tl.arange(0, D)[None, :], v)

    args = ({"D": 128, "R": 16}, {"X": "fp16", "rows": "i32", "y_ptr": "fp16"})
    plain, _ = count(row_gather, *args, warps=1, stages=1)
    aligned, _ = count(row_gather, *args, warps=1, stages=1, div16={"all"})
    # a runtime row stride: 2-byte loads unless it (and X) are known multiples of 16
    assert plain["LDG.E.U16"] > 0 and plain["LDG.E.128"] == 0, plain
    assert aligned["LDG.E.128"] > 0 and aligned["LDG.E.U16"] == 0, aligned
    ptrs_only, _ = count(row_gather, *args, warps=1, stages=1, div16={"ptrs"})
    assert ptrs_only["LDG.E.128"] == 0, ptrs_only  # the stride decides
    named, _ = count(row_gather, *args, warps=1, stages=1, div16={"ptrs", "stride"})
    assert named == aligned, (named, aligned)
    print("ok")
""")


def test_sass_counts_show_divisions_and_alignment(tmp_path):
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=os.pathsep.join([str(BENCH), env.get("PYTHONPATH", "")]),
               TRITON_CACHE_DIR=str(tmp_path), TRITON_DEFAULT_FP_FUSION="1")
    script = tmp_path / "sass_check.py"  # a file, so triton.jit can read the kernels' source
    script.write_text(_SCRIPT)
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True,
                         text=True, timeout=300)
    if out.stdout.strip() == "no-tools":
        pytest.skip("this triton has no bundled CUDA backend tools")
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-3000:]
