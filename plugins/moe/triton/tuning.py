"""Launch tilings of the Triton MoE kernels, as data: the one place to retune them.

Per arch ("sm90": Hopper and newer CUDA, "sm80": Ampere / Ada, "rocm", "interpreter": CPU tests
under TRITON_INTERPRET=1), a list of (max tokens per expert, tiling), smallest bound first; the
first entry whose bound is at least the step's average rows per expert (T * top_k / E) is used,
None meaning "any". A tiling is (block_m, block_n, block_k, num_warps, num_stages); block_m is
also the alignment of each expert's row group, so small bounds want small block_m (decode) and
large ones tall tiles (prefill).

These are starting points, not yet swept on a GPU (see the issue's bench/ sweep, to come).
"""

from __future__ import annotations

Tiling = tuple[int, int, int, int, int]

# The gate/up kernel keeps two fp32 accumulators of block_m x block_n: block_m * block_n is kept
# within 1024 x num_warps (64 registers a thread for both) so tall prefill tiles do not spill.
TABLE: dict[str, tuple[tuple[int | None, Tiling], ...]] = {
    "sm90": ((4, (16, 64, 128, 4, 4)), (16, (16, 128, 128, 4, 3)), (64, (64, 64, 64, 4, 4)),
             (None, (128, 64, 64, 8, 3))),
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
