"""Does compiling Triton kernels on threads run them side by side? (issue 37: a new machine's
start spends ~12 s compiling 25 kernels one after another on the H100 host.)

    TRITON_DEFAULT_FP_FUSION=1 python bench/triton_compile_threads.py --kernels 8 --threads 1,2,4

Compiles N tiled fp16 matmul kernels (distinct functions, so none is a cache hit; an empty
TRITON_CACHE_DIR) for an sm90 target with `triton.compile`, which needs no GPU: PTX and the
cubin through the wheel's own ptxas. Prints the wall seconds for each thread count. If threads
do not shorten it, the compiler holds the GIL and only processes would run compiles in parallel.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--kernels", type=int, default=8)
    p.add_argument("--threads", default="1,2,4")
    a = p.parse_args()
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = GPUTarget("cuda", 90, 32)

    def make():  # a new function object each call: a new kernel to Triton's caches
        @triton.jit
        def kernel(a_ptr, b_ptr, c_ptr, M, N, K, BM: tl.constexpr, BN: tl.constexpr,
                   BK: tl.constexpr):
            # a tiled fp16 matmul with fp32 accumulation: tensor-core code, as the engine's
            # attention and MoE kernels have, so LLVM and ptxas do real work
            rm = tl.program_id(0) * BM + tl.arange(0, BM)
            rn = tl.program_id(1) * BN + tl.arange(0, BN)
            rk = tl.arange(0, BK)
            acc = tl.zeros((BM, BN), dtype=tl.float32)
            for k0 in range(0, K, BK):
                a = tl.load(a_ptr + rm[:, None] * K + (k0 + rk)[None, :],
                            mask=(rm[:, None] < M) & ((k0 + rk)[None, :] < K), other=0.0)
                b = tl.load(b_ptr + (k0 + rk)[:, None] * N + rn[None, :],
                            mask=((k0 + rk)[:, None] < K) & (rn[None, :] < N), other=0.0)
                acc = tl.dot(a, b, acc)
            tl.store(c_ptr + rm[:, None] * N + rn[None, :], acc.to(tl.float16),
                     mask=(rm[:, None] < M) & (rn[None, :] < N))
        return kernel

    def compile_one(i: int) -> None:
        sig = {"a_ptr": "*fp16", "b_ptr": "*fp16", "c_ptr": "*fp16", "M": "i32", "N": "i32",
               "K": "i32", "BM": "constexpr", "BN": "constexpr", "BK": "constexpr"}
        src = ASTSource(fn=make(), signature=sig,
                        constexprs={"BM": 64 << (i % 2), "BN": 64, "BK": 32 << (i % 2)})
        triton.compile(src, target=target)

    compile_one(0)  # the compiler's own first-use costs, outside the timing
    for threads in (int(t) for t in a.threads.split(",")):
        os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="triton_threads_")
        t = time.perf_counter()
        if threads == 1:
            for i in range(a.kernels):
                compile_one(i)
        else:
            with ThreadPoolExecutor(threads) as ex:
                list(ex.map(compile_one, range(a.kernels)))
        print(f"{a.kernels} kernels, {threads} thread(s): {time.perf_counter() - t:.2f} s",
              flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
