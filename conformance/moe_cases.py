"""Which MoE conformance cases a runner gets: the matrix, cut to what its capabilities declare.

Axes: token counts (1..64 small, 1..4096 full), experts 8 to 256, top-k 1 / 2 / 4 / 6 / 8,
routing (random; every token on one expert; all tokens on a few experts, so most experts get
none), renormalize on / off, softmax and sigmoid scoring, grouped top-k, a shared-expert output
to add, the SiLU (and, where declared, GELU: the exact erf form) activation, a
routed_scaling_factor away from 1 (2.5, DeepSeek-V3's; 0.5: every runner must scale the routed
weights, after renormalizing; the shared output is not scaled), GPT-OSS's experts where declared
(the clamped SwiGLU "swigluoai", at its limit 7 and at 0.75 where most values clamp; expert
biases on both projections), DeepSeek-V3's noaux_tc routing where declared (sigmoid scores
plus a correction bias that changes the chosen experts, with and without groups ranked by their
top-2 sum, V3's 256 experts / top 8 / (8, 4) / 2.5 / shared), expert-parallel shares (where
declared: the experts split in 2 or 4, each share run alone, the shares' outputs summed), and
each declared compute dtype. Widths
that are not multiples of the usual tiles (hidden 40, intermediate 48) exercise the masks.

Small cases (the default) keep CPU runs, the Triton interpreter included, to seconds per
runner; full cases (`--conformance-full`, meant for an accelerator) use model-like widths
(Qwen3-30B-A3B's 2048 x 768 for 128 experts) and the whole token range.
"""

from __future__ import annotations

import itertools
import zlib
from dataclasses import dataclass, replace

from core.contract.capabilities import MoECaps

DTYPES = ("float16", "bfloat16", "float32")
ROUTINGS = ("random", "one_expert", "few_experts")


@dataclass(frozen=True)
class MoECase:
    """One MoE step: T tokens of width H routed to k of E experts of width I."""

    tokens: int
    experts: int
    top_k: int
    hidden: int
    inter: int
    dtype: str = "float32"
    routing: str = "random"
    renormalize: bool = True
    scoring: str = "softmax"
    groups: tuple[int, int] | None = None  # grouped top-k: (num_groups, topk_groups)
    shared: bool = False
    activation: str = "silu"
    ep: int = 1  # expert parallel: the experts in `ep` shares, run one by one and summed
    scaling: float = 1.0  # MoELayerParams.routed_scaling_factor
    bias: bool = False  # expert biases (MoEWeights.extra w13_bias / w2_bias: GPT-OSS's)
    swiglu_limit: float = 7.0  # swigluoai's clamp (GPT-OSS's 7; smaller: most values clamped)
    # noaux_tc (DeepSeek-V3): a per-expert correction bias (MoELayerParams.correction_bias),
    # drawn by the builder so that it changes the chosen experts (conformance.moe_check)
    correction_bias: bool = False

    @property
    def id(self) -> str:
        parts = [f"t{self.tokens}", f"e{self.experts}", f"k{self.top_k}",
                 f"h{self.hidden}x{self.inter}", self.dtype, self.routing, self.scoring,
                 "renorm" if self.renormalize else "raw"]
        if self.groups:
            parts.append(f"g{self.groups[0]}of{self.groups[1]}")
        if self.shared:
            parts.append("shared")
        if self.activation != "silu":
            parts.append(self.activation)
        if self.activation == "swigluoai" and self.swiglu_limit != 7.0:
            parts.append(f"limit{self.swiglu_limit:g}")
        if self.bias:
            parts.append("bias")
        if self.ep > 1:
            parts.append(f"ep{self.ep}")
        if self.scaling != 1.0:
            parts.append(f"scaled{self.scaling:g}")
        if self.correction_bias:
            parts.append("cbias")
        return "-".join(parts)

    def seed(self, base: int = 0) -> int:
        return (base * 1_000_003 + zlib.crc32(self.id.encode())) % 2**31


# (tokens, experts, top_k, hidden, inter, routing, renormalize, scoring, groups, shared)
_SMALL = (
    (1, 8, 1, 64, 48, "random", False, "softmax", None, False),
    (5, 8, 2, 64, 48, "random", True, "softmax", None, False),
    (17, 60, 4, 40, 32, "random", False, "softmax", None, True),  # Qwen2-MoE-like, shared
    (6, 64, 8, 64, 32, "random", True, "softmax", (8, 4), False),
    (3, 128, 8, 32, 32, "random", True, "sigmoid", None, False),  # decode: most experts idle
    (64, 8, 4, 32, 48, "one_expert", True, "softmax", None, False),  # 256 rows: PyTorch sort
    (24, 64, 4, 32, 32, "few_experts", False, "sigmoid", (8, 2), True),
    (24, 128, 1, 32, 32, "random", False, "softmax", None, False),
)
_FULL_TOKENS = (1, 2, 3, 16, 64, 127, 512, 1000, 4096)
# (experts, top_k, hidden, inter, scoring, groups, shared, renormalize)
_FULL_SHAPES = (
    (8, 2, 1024, 2048, "softmax", None, False, True),  # Mixtral-like (narrowed)
    (60, 4, 1024, 1408, "softmax", None, True, False),  # Qwen2-MoE-like
    (64, 8, 1024, 1408, "sigmoid", (8, 4), True, True),  # DeepSeek-like
    (128, 8, 2048, 768, "softmax", None, False, True),  # Qwen3-30B-A3B
    (128, 1, 1024, 512, "softmax", None, False, False),
)


def runner_dtypes(caps: MoECaps, exclude: tuple[str, ...] = ()) -> list[str]:
    return [d for d in DTYPES if d in caps.dtypes and d not in exclude]


def _fits(case: MoECase, caps: MoECaps) -> bool:
    return ((case.scoring in caps.scoring_funcs)
            and (case.groups is None or caps.grouped_topk)
            and (not case.shared or caps.shared_experts)
            and (caps.max_experts is None or case.experts <= caps.max_experts)
            and (caps.max_top_k is None or case.top_k <= caps.max_top_k)
            and case.activation in caps.activations
            and (not case.bias or caps.expert_bias)
            and (not case.correction_bias or caps.correction_bias)
            and (case.ep == 1 or caps.expert_parallel))


def all_cases(full: bool = False) -> list[MoECase]:
    """The whole matrix in float32 (dtypes are applied per runner)."""
    if not full:
        cases = [MoECase(t, e, k, h, i, routing=r, renormalize=n, scoring=s, groups=g, shared=sh)
                 for t, e, k, h, i, r, n, s, g, sh in _SMALL]
        cases.append(replace(cases[1], activation="gelu"))
        cases += [replace(cases[1], ep=2), replace(cases[2], ep=4)]  # expert parallel shares
        # routed_scaling_factor: renormalized softmax, raw softmax with a shared expert (not
        # scaled), sigmoid (DeepSeek-V3's 2.5), grouped, and expert-parallel shares
        cases += [replace(cases[1], scaling=2.5), replace(cases[2], scaling=0.5),
                  replace(cases[4], scaling=2.5), replace(cases[6], scaling=2.5),
                  replace(cases[1], scaling=2.5, ep=2)]
        # GPT-OSS's experts: biases (with SiLU too: any activation may come with them), the
        # clamped SwiGLU at its own limit and at 0.75 (most gate / up values clamped), an
        # expert-parallel share of biased experts
        cases += [replace(cases[1], activation="swigluoai", bias=True),
                  replace(cases[2], bias=True),
                  replace(cases[0], activation="swigluoai", swiglu_limit=0.75),
                  replace(cases[5], activation="swigluoai", bias=True, swiglu_limit=0.75),
                  replace(cases[1], activation="swigluoai", bias=True, ep=2)]
        # DeepSeek-V3's noaux_tc: sigmoid scores with a correction bias that moves the choice;
        # ungrouped (Kimi-K2 / Moonlight's one group) at decode and prefill sizes, grouped
        # (8 groups, the best 4 by their top-2 sum), V3's own routing shape (256 experts, top
        # 8, (8, 4), routed_scaling_factor 2.5, a shared expert) at narrow widths, raw weights,
        # and expert-parallel shares
        v3 = dict(scoring="sigmoid", correction_bias=True)
        cases += [MoECase(5, 16, 4, 32, 32, **v3),
                  MoECase(40, 16, 4, 32, 32, shared=True, scaling=2.5, **v3),
                  MoECase(3, 128, 8, 32, 32, renormalize=False, **v3),
                  MoECase(6, 64, 8, 64, 32, groups=(8, 4), shared=True, scaling=2.5, **v3),
                  MoECase(4, 256, 8, 32, 16, groups=(8, 4), shared=True, scaling=2.5, **v3),
                  MoECase(6, 64, 8, 64, 32, groups=(8, 4), scaling=2.5, ep=2, **v3)]
        return cases
    cases = []
    for (e, k, h, i, s, g, sh, n), t in itertools.product(_FULL_SHAPES, _FULL_TOKENS):
        cases.append(MoECase(t, e, k, h, i, renormalize=n, scoring=s, groups=g, shared=sh))
    for t, routing in itertools.product((1, 64, 4096), ("one_expert", "few_experts")):
        cases.append(MoECase(t, 128, 8, 2048, 768, routing=routing))
    cases += [MoECase(t, 128, 8, 2048, 768, ep=4) for t in (1, 512)]
    cases += [MoECase(t, 64, 8, 1024, 1408, scoring="sigmoid", groups=(8, 4), shared=True,
                      scaling=2.5) for t in (1, 127, 1000)]  # DeepSeek-V3-like
    cases += [MoECase(t, 32, 4, 2880, 2880, activation="swigluoai", bias=True)
              for t in (1, 127, 1000)]  # GPT-OSS-20B
    # noaux_tc: DeepSeek-V3's routing (256 experts, top 8, groups (8, 4), 2.5, shared) at a
    # width that fits the reference's fp32 loop; Moonlight's (64 experts, top 6, one group)
    cases += [MoECase(t, 256, 8, 2048, 512, scoring="sigmoid", groups=(8, 4), shared=True,
                      scaling=2.5, correction_bias=True) for t in (1, 16, 127, 1000)]
    cases += [MoECase(t, 64, 6, 2048, 1408, scoring="sigmoid", shared=True, scaling=2.5,
                      correction_bias=True) for t in (1, 127)]
    return cases


def conformance_cases(caps: MoECaps, full: bool = False, exclude: tuple[str, ...] = ()
                      ) -> list[MoECase]:
    """The cases this runner declares it can run: small ones in every dtype; full ones with
    the dtypes rotated through the token counts (fp32 is the slow reference-grade path)."""
    dtypes = runner_dtypes(caps, exclude)
    if not dtypes:
        return []
    cases = [c for c in all_cases(full) if _fits(c, caps)]
    if not full:
        return [replace(c, dtype=d) for c in cases for d in dtypes]
    return [replace(c, dtype=dtypes[i % len(dtypes)]) for i, c in enumerate(cases)]


def not_covered(caps: MoECaps, excluded: dict[str, str] | None = None
                ) -> list[tuple[str, str]]:
    """(key, reason) for each part of the matrix this runner's caps leave out."""
    out = [(f"dtype-{d}", f"compute dtype {d} not declared") for d in DTYPES
           if d not in caps.dtypes]
    out += [(f"dtype-{d}", why) for d, why in (excluded or {}).items() if d in caps.dtypes]
    if "sigmoid" not in caps.scoring_funcs:
        out.append(("scoring-sigmoid", "sigmoid router scoring not declared"))
    if not caps.expert_parallel:
        out.append(("expert-parallel", "expert parallelism (a rank's share of the experts) not "
                                       "declared"))
    if not caps.grouped_topk:
        out.append(("grouped-topk", "grouped top-k routing not declared"))
    if not caps.shared_experts:
        out.append(("shared-experts", "shared experts not declared"))
    if caps.max_experts is not None:
        out.append(("experts", f"cases with more than {caps.max_experts} experts "
                               f"(max_experts)"))
    if caps.max_top_k is not None:
        out.append(("top-k", f"cases with top-k above {caps.max_top_k} (max_top_k)"))
    for act in ("gelu", "swigluoai"):
        if act not in caps.activations:
            out.append((f"activation-{act}", f"{act} activation not declared"))
    if not caps.expert_bias:
        out.append(("expert-bias", "expert biases (GPT-OSS) not declared"))
    if not caps.correction_bias:
        out.append(("correction-bias", "noaux_tc routing with a correction bias (DeepSeek-V3) "
                                       "not declared"))
    other = sorted(set(caps.quant_methods) - {"unquantized"})
    if other:
        out.append(("quant", f"quantized expert weights ({', '.join(other)}): the suite checks "
                             f"unquantized weights only"))
    if not caps.cuda_graph:
        out.append(("cuda-graph", "CUDA-graph capture not declared"))
    return out
