"""`awq` and `gptq`: INT4 weight-only linears (W4A16), from the checkpoints people serve.

Loads AutoAWQ GEMM checkpoints (quant_method "awq": qweight [K, N/8] with AWQ's interleaved
nibbles, qzeros, fp16 scales per group), AutoGPTQ / GPTQModel ones (quant_method "gptq",
checkpoint_format gptq or gptq_v2, sym or not, trivial g_idx only: desc_act is refused), and
compressed-tensors pack-quantized W4A16 (served by `gptq`: the same GPTQ-family weights).
Group sizes 32 / 64 / 128 (GPTQ's -1, one group per row, as well). After loading every format is
in one layout; CUDA sm80+: a Triton dequant-GEMM (split-K narrow tiles for decode); elsewhere
(the CPU): the weight dequantized to the compute dtype on every call, then one matmul - correct,
with no dense copy kept.
"""

from core.contract.capabilities import CapabilityRange, QuantCaps
from core.contract.hookspecs import hookimpl

CORE_PLUGIN_API = ">=1.8,<2"

_COMMON = dict(
    devices={"cuda", "cpu"},
    capability={"cuda": CapabilityRange(min=80)},  # bf16 tl.dot: Ampere and newer
    activation_schemes={"none"},
    weight_bits={4},
    group_sizes={32, 64, 128},
    dtypes={"bfloat16", "float16", "float32"},
    moe=False,  # int4 experts in a MoE runner: not yet (the resolver says so)
    priority={"cuda": 30, "cpu": 10},
)

AWQ_CAPS = QuantCaps(
    config_names={"awq"},
    formats={"int4_awq"},
    description="INT4 weight-only AWQ (AutoAWQ GEMM): Triton dequant-GEMM on CUDA sm80+; "
                "CPU: dequantized per call",
    **_COMMON,
)

GPTQ_CAPS = QuantCaps(
    config_names={"gptq", "compressed-tensors"},
    formats={"int4_gptq", "int4_pack"},
    description="INT4 weight-only GPTQ (gptq / gptq_v2, no act-order) and compressed-tensors "
                "pack-quantized W4A16: Triton dequant-GEMM on CUDA sm80+; CPU: dequantized "
                "per call",
    **_COMMON,
)


@hookimpl
def core_register_quant_methods(register):
    register("awq", AWQ_CAPS, "plugins.quant.int4.method:Int4LinearMethod")
    register("gptq", GPTQ_CAPS, "plugins.quant.int4.method:Int4LinearMethod")
