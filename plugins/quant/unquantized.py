"""`unquantized`: plain dense weights in the compute dtype (the default linear method).

The method is core's dense reference (core.layers.linear.DenseLinearMethod: F.linear, or the
platform's product once a Platform's post-load step repacked the weights); core needs it
itself for router gates and the layers a quantized checkpoint leaves dense.
"""

from core.contract.capabilities import QuantCaps
from core.contract.hookspecs import hookimpl

CORE_PLUGIN_API = ">=1.8,<2"

CAPS = QuantCaps(
    devices={"*"},  # F.linear on any torch device (a vendor's target included)
    # GGUF checkpoints are dequantized to the compute dtype by the loader, then served dense.
    config_names={"none", "gguf"},
    formats={"dense", "gguf"},
    dtypes={"float32", "float16", "bfloat16"},
    moe=True,
    priority={"cpu": 10, "cuda": 10, "rocm": 10, "xpu": 10, "npu": 10},
    description="dense weights, F.linear (GGUF is dequantized at load)",
    tensor_parallel=True,
    dense_weights=True,  # DenseLinearMethod: its weights are dense (GGUF dequantized first)
)


@hookimpl
def core_register_quant_methods(register):
    register("unquantized", CAPS, "core.layers.linear:DenseLinearMethod")
