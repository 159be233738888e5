"""`triton` MoE runner: tokens sorted by expert, two grouped-GEMM Triton kernels.

Declared here without importing triton; the kernels live in `kernels.py`, the class in
`runner.py` and the launch tilings in `tuning.py`, imported only when this runner is chosen.
Under TRITON_INTERPRET=1 the same kernels run on CPU tensors (how CI tests them; not a serving
path, so "cpu" is not a declared device).
"""

from core.contract.capabilities import CapabilityRange, MoECaps
from core.contract.hookspecs import hookimpl

CORE_PLUGIN_API = ">=1.0,<2"

CAPS = MoECaps(
    devices={"cuda", "rocm"},
    capability={"cuda": CapabilityRange(min=80)},  # tl.dot on bf16 needs Ampere
    # fp32 runs with IEEE dots (no TF32), for reference-grade checks; serving uses fp16 / bf16.
    dtypes={"float16", "bfloat16", "float32"},
    # fp8: block-scaled experts only (Qwen3-FP8 / DeepSeek's 128x128 weight_scale_inv);
    # mxfp4: packed e2m1 + e8m0 experts decoded in the GEMMs (weight-only)
    quant_methods={"unquantized", "fp8", "mxfp4"},
    quant_formats={"fp8_block", "mxfp4"},
    # the gated activation is fused into the gate/up kernel's epilogue, in fp32: SiLU, GELU
    # (erf form) and GPT-OSS's clamped swigluoai; expert biases (GPT-OSS's, any weight form)
    # are added in both kernels' epilogues
    activations={"silu", "gelu", "swigluoai"},
    scoring_funcs={"softmax", "sigmoid"},
    grouped_topk=True,
    # noaux_tc (DeepSeek-V3, Kimi-K2): the correction bias in the Triton routing kernels
    # (ungrouped) or select_experts itself (grouped)
    correction_bias=True,
    expert_bias=True,
    shared_experts=True,
    # The routing weights are gathered per (token, slot) row; 2^31 rows would be needed to
    # overflow, so no limit on experts; top-k is bounded by the experts only.
    max_experts=None,
    max_top_k=None,
    # Routing, the sort by expert and both kernels take every size from T, k and E (the grid
    # is sized for the worst case and idle blocks exit on a device-side count): no host sync,
    # so decode steps can be captured.
    cuda_graph=True,
    deterministic=True,  # no atomics: the k partial rows are summed in a fixed order
    requires=("triton",),
    priority={"cuda": 20, "rocm": 20},
    description="Triton fused MoE: expert-sorted tokens, grouped GEMMs (gate+up with the gated "
                "activation, down with the routing weights), fp8 block and mxfp4 experts "
                "dequantized in them; ROCm declared but untested",
)


@hookimpl
def core_register_moe_runners(register):
    register("triton", CAPS, "plugins.moe.triton.runner:TritonMoE")
