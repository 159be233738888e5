"""`w8a8_int8`: int8 weights per output channel with int8 activations per token (SmoothQuant-
style W8A8), from compressed-tensors `int-quantized` checkpoints, SGLang's `w8a8_int8` ones, or a
dense checkpoint quantized at load (`--quantization w8a8_int8`). CUDA: Triton kernels (a fused
decode GEMV with the activation quantization inside; int8 dots scaled per K step for larger M);
the CPU: `torch._int_mm` (int32 accumulation), the scales applied in fp32 after it.
"""

from core.contract.capabilities import CapabilityRange, QuantCaps
from core.contract.hookspecs import hookimpl

CORE_PLUGIN_API = ">=1.8,<2"

CAPS = QuantCaps(
    devices={"cuda", "cpu"},
    capability={"cuda": CapabilityRange(min=80)},  # Triton int8 dots: Ampere and newer
    config_names={"compressed-tensors", "w8a8_int8"},
    formats={"int8_channel"},
    activation_schemes={"dynamic", "static"},
    online_format="int8_channel",
    weight_bits={8},
    dtypes={"bfloat16", "float16", "float32"},
    moe=False,
    priority={"cuda": 30, "cpu": 20},
    description="INT8 W8A8: per-channel weights, per-token dynamic (or static per-tensor) "
                "activations; Triton on CUDA, torch._int_mm on the CPU",
)


@hookimpl
def core_register_quant_methods(register):
    register("w8a8_int8", CAPS, "plugins.quant.int8.method:Int8LinearMethod")
