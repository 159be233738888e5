"""Launch tilings of the Triton MoE kernels, as data: the one place to retune them.

Per arch ("sm90": Hopper and newer CUDA, "sm80": Ampere / Ada, "rocm", "interpreter": CPU tests
under TRITON_INTERPRET=1), a list of (max tokens per expert, tiling), smallest bound first; the
first entry whose bound is at least the step's average rows per expert (T * top_k / E) is used,
None meaning "any". A tiling is (block_m, block_n, block_k, num_warps, num_stages); block_m is
also the alignment of each expert's row group, so small bounds want small block_m (decode) and
large ones tall tiles (prefill).

sm90 comes from an H200 sweep (bench/sweep_moe.py --quick, 2026-12-01); the others are starting
points, not swept.
"""

from __future__ import annotations

Tiling = tuple[int, int, int, int, int]

# The gate/up kernel keeps two fp32 accumulators of block_m x block_n: block_m * block_n is kept
# within 1024 x num_warps (64 registers a thread for both) so tall prefill tiles do not spill.
TABLE: dict[str, tuple[tuple[int | None, Tiling], ...]] = {
    # H200 quick sweep, 2026-12-01 (bench/sweep_moe.py --quick): the least-loss tiling per bucket
    "sm90": ((4, (16, 32, 128, 4, 4)), (16, (64, 128, 64, 4, 4)), (64, (64, 64, 64, 4, 4)),
             (None, (128, 128, 64, 8, 3))),
    "sm80": ((4, (16, 64, 128, 4, 4)), (16, (16, 128, 64, 4, 3)), (64, (64, 64, 32, 4, 4)),
             (None, (128, 64, 32, 8, 3))),
    "rocm": ((16, (16, 64, 64, 4, 1)), (None, (64, 64, 64, 4, 1))),
    "interpreter": ((None, (16, 32, 32, 1, 1)),),
}


def pick(arch: str, rows_per_expert: float) -> Tiling:
    """The tiling for `arch` at this many (token, slot) rows per expert on average."""
    entries = TABLE.get(arch) or TABLE["sm80"]
    for bound, tiling in entries:
        if bound is None or rows_per_expert <= bound:
            return tiling
    return entries[-1][1]


# Shared memory a program may use: the H100/H200 opt-in limit is 227 KiB, A100's 163 KiB; the
# pipelined loads of the gate/up kernel (x tile + gate and up weight tiles, per stage) must fit.
SMEM_BYTES = {"sm90": 227 * 1024, "sm80": 163 * 1024, "rocm": 64 * 1024}


def fit_dtype(tiling: Tiling, elem_bytes: int, arch: str) -> Tiling:
    """The table's tilings are for 16-bit types; wider elements (fp32) get fewer pipeline stages
    and, where one stage is still too big, a shorter block_k, so the kernel fits in shared
    memory (the H200 refused an fp32 decode tile needing 272 KiB)."""
    block_m, block_n, block_k, warps, stages = tiling
    limit = SMEM_BYTES.get(arch)
    if limit is None:  # the interpreter has no shared memory to run out of
        return tiling

    def per_stage(bk: int) -> int:
        return (block_m + 2 * block_n) * bk * elem_bytes

    while block_k > 16 and per_stage(block_k) * 2 > limit:
        block_k //= 2
    stages = max(1, min(stages, limit // per_stage(block_k)))
    return block_m, block_n, block_k, warps, stages
