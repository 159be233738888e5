"""Launch parameters of the Triton attention kernels, as data: the one place to retune them.

bench/sweep_triton.py times candidate tilings on a GPU and prints replacement entries for these
tables. Keys are (arch, width):

- arch: "sm90" (Hopper and newer CUDA), "sm80" (Ampere / Ada), "rocm";
- width: "d64" (16-bit compute, head dim <= 64), "d128" (16-bit, head dim <= 128), "d256"
  (16-bit, head dim <= 256: Gemma's 256), "wide" (fp32 compute, or head dim > 256: larger
  register and shared-memory tiles). The d256 entries start as the wide ones
  (`bench/sweep_triton.py --shape gemma2` sweeps them).

Decode entries: (block_n, num_warps, num_stages, waves, min_split_tokens). The split count is
chosen so that B x KV heads x splits programs fill every SM `waves` times over, each split covering
at least min_split_tokens of the longest context (common.num_kv_splits).

Extend entries: candidate tilings (block_m, block_n, num_warps, num_stages[, pack_gqa[, maxnreg]]),
best first; pack_gqa puts the query heads of one KV head in a program's rows, maxnreg caps the
registers per thread (ExtendConfig). With autotuning on (CORE_TRITON_AUTOTUNE=1; default off)
the autotuner times them on the first call of a shape class; off, the first one runs. A
problem too small to give every SM a program falls back to the first candidate with a smaller
block_m (common.extend_configs).
"""

from __future__ import annotations

DECODE: dict[tuple[str, str], tuple[int, int, int, int, int]] = {
    ("sm90", "d64"): (64, 4, 2, 4, 256),
    # H200 sweep 2026-11-29 (bench/sweep_triton.py): least loss over every decode shape
    ("sm90", "d128"): (64, 4, 3, 2, 128),
    ("sm90", "wide"): (32, 4, 2, 4, 256),
    # H100 sweep 2026-12-07 (sweep_triton.py --shape gemma2: 16 / 8 heads of 256, batch 1-256,
    # context 512-32k): least loss over every shape, geometric mean 1.02, worst 1.09; the wide
    # entry it replaces lost up to 1.7x at batch 1 and short contexts (2 splits where 8 pay)
    ("sm90", "d256"): (64, 4, 3, 1, 128),
    ("sm80", "d64"): (64, 4, 2, 4, 256),
    ("sm80", "d128"): (64, 4, 2, 4, 256),
    ("sm80", "wide"): (32, 4, 2, 4, 256),
    ("rocm", "d64"): (64, 4, 1, 4, 256),
    ("rocm", "d128"): (32, 4, 1, 4, 256),
    ("rocm", "wide"): (32, 4, 1, 4, 256),
}

# (block_m, block_n, num_warps, num_stages) with optional pack_gqa flag and maxnreg cap
EXTEND: dict[tuple[str, str], tuple[tuple[int | bool, ...], ...]] = {
    ("sm90", "d64"): ((128, 64, 4, 3), (128, 128, 8, 3), (64, 64, 4, 3)),
    # H200 sweep 2026-11-30 (bench/sweep_triton.py, after the kernel's 32-bit offsets): 128-row
    # tiles capped at 128 registers, two programs per SM, unpacked and GQA-packed within 1-3%
    # of each other (prefix 4k + new 4k: 0.814 / 0.840 ms; the 256-row tile that led before:
    # 1.015 ms in the same sweep); then the 256-row tiles.
    ("sm90", "d128"): ((128, 64, 8, 3, False, 128), (128, 64, 8, 3, True, 128),
                       (256, 64, 16, 3, True),
                       (256, 64, 16, 2, True), (256, 64, 16, 2), (128, 64, 4, 3, True),
                       (128, 64, 4, 3), (128, 128, 8, 3)),
    # (64, 64) needs 213 KB of shared memory for fp32 at d=256: Hopper only.
    ("sm90", "wide"): ((64, 32, 4, 2), (64, 64, 8, 2), (32, 32, 4, 2)),
    ("sm80", "d64"): ((128, 64, 4, 3), (64, 64, 4, 3)),
    ("sm80", "d128"): ((128, 64, 4, 3), (64, 64, 4, 3), (128, 32, 4, 3)),
    ("sm80", "wide"): ((64, 32, 4, 2), (32, 32, 4, 2)),
    # 64 KB of LDS per CU: small tiles, no multi-buffering (untested).
    ("rocm", "d64"): ((64, 64, 4, 1), (64, 32, 4, 1)),
    ("rocm", "d128"): ((64, 64, 4, 1), (64, 32, 4, 1), (32, 32, 4, 1)),
    ("rocm", "wide"): ((32, 32, 4, 1),),
}

# d256 (16-bit, head dim 129..256) starts as the wide entries where not swept
for _arch in ("sm90", "sm80", "rocm"):
    DECODE.setdefault((_arch, "d256"), DECODE[_arch, "wide"])
    EXTEND.setdefault((_arch, "d256"), EXTEND[_arch, "wide"])

# Short extensions that leave SMs idle with the first EXTEND tiling (common.small_extend_config);
# keys missing here use block_m 64 with the first tiling's block_n.
EXTEND_SMALL: dict[tuple[str, str], tuple[int, int, int, int]] = {
    # H200 sweep 2026-11-30: best at prefix 0/4096/8192 + 128 new (0.081 vs 0.135 ms at 4096)
    ("sm90", "d128"): (64, 128, 4, 2),
}

# Under TRITON_INTERPRET=1 (CPU): tiny tiles keep the interpreter quick.
INTERPRET_DECODE = (32, 1, 1, 1, 32)
INTERPRET_EXTEND = (32, 32, 1, 1)
