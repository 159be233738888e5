"""`torch` layer ops: the reference, in plain PyTorch (core/layers/ops_ref.py), on every device."""

from core.contract.capabilities import DEVICE_TYPES, LayerOpsCaps
from core.contract.hookspecs import hookimpl

CORE_PLUGIN_API = ">=1.1,<2"

CAPS = LayerOpsCaps(
    devices={"*"},  # plain PyTorch: any target's torch device
    dtypes={"float32", "float16", "bfloat16"},
    ops={"rms_norm", "add_rms_norm", "silu_and_mul", "rotary_qk", "store_kv", "qk_norm_rotary",
         "linear", "gelu_and_mul", "norm_add_norm"},
    cuda_graph=True,
    priority={d: 10 for d in DEVICE_TYPES},
    description="PyTorch ops (the reference every layer-ops plugin is checked against)",
)


@hookimpl
def core_register_layer_ops(register):
    register("torch", CAPS, "core.layers.ops_ref:TorchLayerOps")
