"""`mxfp4`: OCP Microscaling FP4 MoE experts (E2M1 values, one E8M0 scale per 32), the format
of GPT-OSS checkpoints (quant_method "mxfp4"), weight-only.

Only the MoE experts are MXFP4 in these checkpoints (transformers' own mxfp4 integration
quantizes nothing else): every linear, the router, the embedding and the LM head stay dense in
the compute dtype, as `modules_to_not_convert` lists them. The experts stay packed (the
checkpoint's bytes: 4.25 bits a weight) on every device and are dequantized inside the MoE
runner: the `triton` runner's grouped GEMMs decode each tile in registers (CUDA sm80+: its bf16
tl.dot), the `torch_native` runner dequantizes each active expert per call (the CPU and the
reference). Layout and decoding: plugins/_kit/mxfp4.py; the method: method.py.
"""

from core.contract.capabilities import CapabilityRange, QuantCaps
from core.contract.hookspecs import hookimpl

CORE_PLUGIN_API = ">=1.8,<2"

CAPS = QuantCaps(
    devices={"cuda", "cpu"},
    # the experts' dequantizing Triton MoE kernels use tl.dot on bf16: Ampere and newer
    capability={"cuda": CapabilityRange(min=80)},
    config_names={"mxfp4"},
    formats={"mxfp4"},
    activation_schemes={"none"},  # weight-only: x stays in the compute dtype
    weight_bits={4},
    dtypes={"bfloat16", "float16", "float32"},
    moe=True,  # form "mxfp4" experts; the runners that run them name mxfp4 in their MoECaps
    priority={"cuda": 30, "cpu": 10},
    dense_weights=True,  # its linears are dense (DenseLinearMethod): MLA's kv_b_proj as it is
    description="MXFP4 MoE experts (GPT-OSS: e2m1 + e8m0 per 32), weight-only, kept packed; "
                "dequantized in the triton runner's GEMMs (CUDA sm80+) or per expert by "
                "torch_native (CPU); other layers dense",
)


@hookimpl
def core_register_quant_methods(register):
    register("mxfp4", CAPS, "plugins.quant.mxfp4.method:Mxfp4Method")
