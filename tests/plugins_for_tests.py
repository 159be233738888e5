"""In-process test plugins: declarations shaped like SGLang's backends, for resolver tests.

Every backend here is a TEST DOUBLE: its capabilities mirror a real SGLang backend's rules (FlashMLA
needs page size 64, cutlass MLA 128 on Blackwell, FA3 stores FP8 KV only as e4m3, flex attention
cannot be captured in CUDA graphs, intel_amx needs AMX, GPT-OSS needs sinks) but its factory raises
NotImplementedError: resolver tests decide, they never build a kernel. Names end in `_like` so a
plan that mentions one cannot be mistaken for the real backend.
"""

from __future__ import annotations

from core.contract.capabilities import (
    AttentionCaps,
    CapabilityRange,
    ModelCaps,
    MoECaps,
    PageSizes,
    QuantCaps,
)
from core.contract.hookspecs import hookimpl

MISSING_PACKAGE = "core_test_missing_kernel_pkg"  # a package no environment installs


def double_factory(*args, **kwargs):
    """Factory of every test double: resolver tests must never build one."""
    raise NotImplementedError("test double: declared for resolver tests only, has no kernel")


def _cuda(lo: int | None = None, hi: int | None = None) -> dict[str, CapabilityRange]:
    return {"cuda": CapabilityRange(min=lo, max=hi)}


HALF = {"float16", "bfloat16"}
MHA_KINDS = {"MHA", "GQA", "MQA"}

ATTENTION: dict[str, AttentionCaps] = {
    # FlashMLA: MLA only, Hopper/Blackwell, pages of exactly 64 tokens.
    "flashmla_like": AttentionCaps(
        devices={"cuda"}, capability=_cuda(90, 100), dtypes=HALF,
        kv_cache_dtypes={"float16", "bfloat16", "fp8_e4m3"}, head_sizes={576},
        page_sizes=PageSizes.of(64), attention_kinds={"MLA"}, cuda_graph=True,
        priority={"cuda": 90}, description="test double of flashmla"),
    # cutlass MLA: decode only, Blackwell only, pages of 128.
    "cutlass_mla_like": AttentionCaps(
        devices={"cuda"}, capability=_cuda(100, 100), dtypes=HALF,
        kv_cache_dtypes={"float16", "bfloat16", "fp8_e4m3"}, head_sizes={576},
        page_sizes=PageSizes.of(128), attention_kinds={"MLA"}, phases={"decode"},
        cuda_graph=True, priority={"cuda": 95}, description="test double of cutlass_mla"),
    # FA3: sm80-sm90, FP8 KV only as e4m3, the Hopper default.
    "fa3_like": AttentionCaps(
        devices={"cuda"}, capability=_cuda(80, 90), dtypes=HALF,
        kv_cache_dtypes={"float16", "bfloat16", "fp8_e4m3"}, head_sizes={64, 96, 128, 256},
        page_sizes=PageSizes.any(), attention_kinds=MHA_KINDS, sliding_window=True,
        logit_softcap=True, cuda_graph=True, priority={"cuda": 100},
        description="test double of fa3"),
    # flex attention: works everywhere on CUDA, but cannot be captured in a graph.
    "flex_like": AttentionCaps(
        devices={"cuda"}, page_sizes=PageSizes.any(), attention_kinds=MHA_KINDS,
        sliding_window=True, logit_softcap=True, cuda_graph=False, priority={"cuda": 5},
        description="test double of flex_attention"),
    # intel_amx: CPU with AMX tiles, bf16 compute.
    "amx_like": AttentionCaps(
        devices={"cpu"}, cpu_isa={"amx_tile", "amx_bf16"}, dtypes={"bfloat16"},
        kv_cache_dtypes={"bfloat16"}, attention_kinds=MHA_KINDS, priority={"cpu": 50},
        description="test double of intel_amx"),
    # trtllm_mha: attention sinks (GPT-OSS) and sliding windows, pages of 16, 32 or 64.
    "sinks_like": AttentionCaps(
        devices={"cuda"}, capability=_cuda(90, 100), dtypes=HALF,
        kv_cache_dtypes={"float16", "bfloat16", "fp8_e4m3"}, head_sizes={64, 128},
        page_sizes=PageSizes.of(16, 32, 64), attention_kinds=MHA_KINDS, sliding_window=True,
        sinks=True, cuda_graph=True, priority={"cuda": 80},
        description="test double of trtllm_mha"),
    # triton: the portable GPU fallback, MLA included, FP8 KV in both flavours.
    "triton_like": AttentionCaps(
        devices={"cuda", "rocm", "xpu"},
        kv_cache_dtypes={"float32", "float16", "bfloat16", "fp8_e4m3", "fp8_e5m2"},
        page_sizes=PageSizes.any(), attention_kinds={*MHA_KINDS, "MLA"}, sliding_window=True,
        logit_softcap=True, cuda_graph=True, priority={"cuda": 50, "rocm": 50, "xpu": 50},
        description="test double of triton"),
    # flashinfer: would win everywhere on CUDA, but its package is not installed.
    "missing_pkg_like": AttentionCaps(
        devices={"cuda"}, page_sizes=PageSizes.any(), attention_kinds=MHA_KINDS,
        sliding_window=True, logit_softcap=True, cuda_graph=True,
        requires=(MISSING_PACKAGE,), priority={"cuda": 200},
        description="test double of flashinfer (package missing)"),
}

# MoECaps.quant_methods name registered quant methods, hence the doubles' names here.
MOE: dict[str, MoECaps] = {
    "fused_moe_like": MoECaps(
        devices={"cuda", "rocm"}, dtypes=HALF, quant_methods={"unquantized", "fp8_like"},
        activations={"silu", "gelu"}, grouped_topk=True, shared_experts=True, cuda_graph=True,
        priority={"cuda": 50, "rocm": 50}, description="test double of triton fused MoE"),
    "mxfp4_moe_like": MoECaps(
        devices={"cuda"}, capability=_cuda(90, None), dtypes=HALF, quant_methods={"mxfp4_like"},
        activations={"silu", "swiglu", "swigluoai"}, expert_bias=True, cuda_graph=True,
        priority={"cuda": 60},
        description="test double of flashinfer_mxfp4 / triton_kernel"),
}

QUANT: dict[str, QuantCaps] = {
    "fp8_like": QuantCaps(
        devices={"cuda", "rocm"}, capability=_cuda(89, None), config_names={"fp8"},
        dtypes=HALF, weight_bits={8}, moe=True, needs_features={"fp8"},
        priority={"cuda": 20, "rocm": 20}, description="test double of fp8"),
    "mxfp4_like": QuantCaps(
        devices={"cuda"}, capability=_cuda(90, None), config_names={"mxfp4"}, dtypes=HALF,
        weight_bits={4}, moe=True, priority={"cuda": 20}, description="test double of mxfp4"),
}

MODELS: dict[str, ModelCaps] = {
    "llama_like": ModelCaps(architectures={"LlamaForCausalLM", "MistralForCausalLM"},
                            description="test double of a model implementation"),
}


class AttentionDoubles:
    """Registers every attention test double."""

    @hookimpl
    def core_register_attention_backends(self, register):
        for name, caps in ATTENTION.items():
            register(name, caps, double_factory)


class MoEDoubles:
    @hookimpl
    def core_register_moe_runners(self, register):
        for name, caps in MOE.items():
            register(name, caps, double_factory)


class QuantDoubles:
    @hookimpl
    def core_register_quant_methods(self, register):
        for name, caps in QUANT.items():
            register(name, caps, double_factory)


class ModelDoubles:
    @hookimpl
    def core_register_models(self, register):
        for name, caps in MODELS.items():
            register(name, caps, double_factory)


def double_plugins() -> list[tuple[str, object]]:
    """(name, plugin) pairs for core.plan.registry.build_registry(extra=...)."""
    return [("test_attention_doubles", AttentionDoubles()), ("test_moe_doubles", MoEDoubles()),
            ("test_quant_doubles", QuantDoubles()), ("test_model_doubles", ModelDoubles())]


def builtin_backend_plugins() -> list[tuple[str, object]]:
    """The built-in reference backends as in-process plugins (no hardware, no entry points)."""
    import plugins.attention.torch_native as attention_torch_native
    import plugins.moe.torch_native as moe_torch_native
    import plugins.ops.torch_ref as ops_torch
    import plugins.quant.unquantized as quant_unquantized

    return [("attention_torch_native", attention_torch_native),
            ("moe_torch_native", moe_torch_native),
            ("quant_unquantized", quant_unquantized), ("ops_torch", ops_torch)]
