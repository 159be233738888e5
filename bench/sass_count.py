"""Compile a Triton kernel for a CUDA target on any machine (no GPU needed) and count its SASS
instructions: a static check of what a kernel change costs when no GPU is at hand.

    python bench/sass_count.py plugins._kit.w8a8_triton:_small_m_kernel \
        --const ACT=0,BLOCKED_W=0,GROUP_N=1,QMAX=448.0,IS_INT=0,HAS_BIAS=0,HAS_UB=0,SPLIT_K=2,\
BLOCK_M=16,BLOCK_N=64,BLOCK_K=128,PRO_R=4,PRO_K=1024 \
        --ptr w_ptr=fp8e4nv,x_ptr=bf16,y_ptr=bf16,bias_ptr=bf16,lock_ptr=i32 --warps 4 --stages 3
    # the same kernel as another file holds it (e.g. an older revision, `git show REV:PATH`):
    python bench/sass_count.py /tmp/old_w8a8.py:_small_m_kernel ...

Arguments named *_ptr are pointers (fp32 unless --ptr names their type), so are the others
--ptr names; other runtime arguments are i32 unless --scalar gives their type. Prints the total,
the most frequent opcodes and the MUFU / CALL counts (IEEE divisions show as a MUFU.RCP, FFMAs
and a CALL to their slow path); --out keeps the disassembly. Counts are static (every branch,
slow paths included) and come from the installed triton, which may differ from a GPU machine's.

Alignment: on a GPU, Triton's launcher compiles every pointer that is 16-byte aligned (torch's
allocations are) and every integer argument that is a multiple of 16 (strides such as 4096) with
that fact, and the compiler vectorizes loads along them. Without --div16 nothing is assumed
(scalar loads where a runtime stride is involved); `--div16 all` is the usual GPU launch of
aligned tensors and round shapes.
"""

from __future__ import annotations

import argparse
import collections
import importlib
import importlib.util
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _kernel(spec: str):
    where, name = spec.rsplit(":", 1)
    if where.endswith(".py"):
        mspec = importlib.util.spec_from_file_location(Path(where).stem, where)
        mod = importlib.util.module_from_spec(mspec)
        mspec.loader.exec_module(mod)
    else:
        mod = importlib.import_module(where)
    return getattr(mod, name)


def _value(text: str):
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return {"true": True, "false": False, "none": None}.get(text.lower(), text)


def count(kernel, consts: dict, ptrs: dict, warps: int, stages: int, arch: int = 90,
          scalars: dict | None = None, div16: set[str] | frozenset[str] = frozenset()):
    """(opcode counter, disassembly) of `kernel` compiled for sm_<arch>. Arguments named in
    `ptrs` (and any other *_ptr) are pointers, those in `scalars` scalars of that type. `div16`:
    the arguments compiled as multiples of 16 (pointers: 16-byte aligned), as Triton's launcher
    specializes them when their values are; "ptrs" stands for every pointer, "all" for every
    pointer and integer."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    constexprs = {kernel.arg_names[i] for i in kernel.constexprs}
    sig = {}
    for n in kernel.arg_names:
        if n in constexprs:
            sig[n] = "constexpr"
        elif n in ptrs or n.endswith("_ptr"):
            sig[n] = "*" + ptrs.get(n, "fp32")
        else:
            sig[n] = (scalars or {}).get(n, "i32")
    unknown = (set(consts) - constexprs) | (set(ptrs) | set(scalars or {})) - set(sig)
    named = set(div16) - {"ptrs", "all"}
    unknown |= named - {n for n, t in sig.items() if t.startswith("*") or t[0] in "iu"}
    if unknown:
        raise SystemExit(f"not arguments of {kernel.__name__} (or not constexpr, for --const): "
                         f"{sorted(unknown)}")
    aligned = [i for i, n in enumerate(kernel.arg_names) if n in sig and (
        n in named or (sig[n].startswith("*") and div16 & {"ptrs", "all"})
        or ("all" in div16 and sig[n][0] in "iu"))]
    src = ASTSource(fn=kernel, signature=sig, constexprs=consts,
                    attrs={(i,): [["tt.divisibility", 16]] for i in aligned})
    compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32),
                              options={"num_warps": warps, "num_stages": stages})
    nvdisasm = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/nvdisasm")
    with tempfile.TemporaryDirectory() as d:
        cubin = Path(d) / "k.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        text = subprocess.run([nvdisasm, "-c", str(cubin)], capture_output=True, text=True,
                              check=True).stdout
    ops = re.findall(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)", text, re.M)
    return collections.Counter(ops), text


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("kernel", help="module.path:kernel or file.py:kernel")
    p.add_argument("--const", default="", help="NAME=VALUE,... for every constexpr argument")
    p.add_argument("--ptr", default="", help="NAME=DTYPE,... (fp8e4nv, bf16, fp16, i32, ...): "
                   "pointer arguments (those named *_ptr are pointers anyway, fp32 if unnamed)")
    p.add_argument("--scalar", default="", help="NAME=TYPE,... (fp32, i64, ...) for scalar "
                   "arguments other than i32")
    p.add_argument("--div16", default="", help="NAME,... compiled as multiples of 16 (what "
                   "the launcher does for values that are): 'ptrs' = every pointer, 'all' = "
                   "every pointer and integer; default none")
    p.add_argument("--warps", type=int, default=4)
    p.add_argument("--stages", type=int, default=3)
    p.add_argument("--arch", type=int, default=90)
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--out", default=None, help="write the disassembly here")
    a = p.parse_args(argv)
    consts = {k: _value(v) for k, v in (kv.split("=", 1) for kv in a.const.split(",") if kv)}
    ptrs = dict(kv.split("=", 1) for kv in a.ptr.split(",") if kv)
    scalars = dict(kv.split("=", 1) for kv in a.scalar.split(",") if kv)
    div16 = {n for n in a.div16.split(",") if n}
    ops, text = count(_kernel(a.kernel), consts, ptrs, a.warps, a.stages, a.arch, scalars,
                      div16)
    if a.out:
        Path(a.out).write_text(text)
    mufu = sum(v for o, v in ops.items() if o.startswith("MUFU"))
    print(f"{a.kernel}: {sum(ops.values())} SASS instructions (sm_{a.arch}), MUFU {mufu}, "
          f"CALL {sum(v for o, v in ops.items() if o.startswith('CALL'))}")
    for op, n in ops.most_common(a.top):
        print(f"  {op:28s} {n}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
