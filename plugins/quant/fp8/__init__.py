"""`fp8`: e4m3 weights with fp8 activations (W8A8), from the checkpoint formats people serve.

Loads: block-wise weights with `weight_scale_inv` per 128x128 block and dynamic per-token-group
activation scales (quant_method "fp8" with weight_block_size: Qwen3-*-FP8, DeepSeek); per-tensor
"fp8" checkpoints (static or dynamic activations); compressed-tensors `float-quantized` (per
tensor, per channel, block; static or dynamic); FBGEMM row-wise (`fbgemm_fp8`); and quantizes a
dense checkpoint at load with `--quantization fp8` (per-channel weights, dynamic per-token
activations). CUDA sm89+: decode-sized batches (M <= 16) in one Triton launch with the activation
quantization fused in; larger M: activations quantized in one Triton launch, then
`torch._scaled_mm` (per-channel / per-tensor scales) or a Triton block-scaled GEMM (block
scales). Elsewhere (the CPU): an fp32 reference that dequantizes on every call - correct, slow, for checking and for serving where nothing better exists.
"""

from core.contract.capabilities import CapabilityRange, QuantCaps
from core.contract.hookspecs import hookimpl

CORE_PLUGIN_API = ">=1.8,<2"

CAPS = QuantCaps(
    devices={"cuda", "cpu"},
    capability={"cuda": CapabilityRange(min=89)},  # e4m3 tensor cores: Ada, Hopper and newer
    config_names={"fp8", "fbgemm_fp8", "compressed-tensors"},
    formats={"fp8_block", "fp8_channel", "fp8_tensor"},
    activation_schemes={"dynamic", "static"},
    online_format="fp8_channel",
    weight_bits={8},
    dtypes={"bfloat16", "float16", "float32"},
    moe=True,  # experts in form "fp8" (core.contract.moe); the triton runner declares fp8_block ones
    moe_runners={"torch_native"},
    priority={"cuda": 30, "cpu": 1},
    dense_weights=True,  # QuantMethod.dense_weight: MLA's kv_b_proj, dequantized at load
    description="FP8 e4m3 W8A8: block-wise (Qwen3/DeepSeek FP8), per-tensor / per-channel "
                "(compressed-tensors, FBGEMM), online from bf16; CUDA sm89+: fused Triton decode "
                "GEMV, _scaled_mm and a Triton block GEMM; CPU: fp32 reference (slow)",
)


@hookimpl
def core_register_quant_methods(register):
    register("fp8", CAPS, "plugins.quant.fp8.method:Fp8LinearMethod")
