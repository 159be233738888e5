"""`torch_native` MoE runner: routing and expert MLPs in plain PyTorch, on any device."""

from core.contract.capabilities import MoECaps
from core.contract.hookspecs import hookimpl

CORE_PLUGIN_API = ">=1.0,<2"

CAPS = MoECaps(
    devices={"cuda", "rocm", "xpu", "npu", "cpu"},
    dtypes={"float32", "float16", "bfloat16"},
    # fp8 and mxfp4: each active expert dequantized per call (a reference, slow)
    quant_methods={"unquantized", "fp8", "mxfp4"},
    activations={"silu", "gelu", "swigluoai"},
    scoring_funcs={"softmax", "sigmoid"},
    grouped_topk=True,
    correction_bias=True,
    expert_bias=True,
    shared_experts=True,
    cuda_graph=False,
    deterministic=True,
    expert_parallel=True,
    priority={"cpu": 10, "cuda": 1, "rocm": 1, "xpu": 1, "npu": 1},
    description="per-expert loop in PyTorch (reference runner)",
)


@hookimpl
def core_register_moe_runners(register):
    register("torch_native", CAPS, "plugins.moe.torch_native.runner:TorchNativeMoE")
