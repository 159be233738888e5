"""`triton` layer ops: fused RMSNorm, add+RMSNorm, norm+add+norm (Gemma), SiLU- and
GELU-and-mul, rotary on q/k (MLA's too) and the KV store as Triton kernels
(plugins/ops/triton/kernels.py) on CUDA and ROCm GPUs."""

from core.contract.capabilities import LayerOpsCaps
from core.contract.hookspecs import hookimpl

CORE_PLUGIN_API = ">=1.1,<2"

CAPS = LayerOpsCaps(
    devices={"cuda", "rocm"},
    dtypes={"float32", "float16", "bfloat16"},
    ops={"rms_norm", "add_rms_norm", "silu_and_mul", "rotary_qk", "store_kv", "qk_norm_rotary",
         "linear", "rotary_mla", "gelu_and_mul", "norm_add_norm"},
    requires=("triton",),
    cuda_graph=True,
    priority={"cuda": 100, "rocm": 100},
    description="fused element-wise Triton kernels (one kernel per norm / activation / rotary / "
                "q/k norm + rotary / KV store) and a few-row dense product for decode",
)


@hookimpl
def core_register_layer_ops(register):
    register("triton", CAPS, "plugins.ops.triton.ops:TritonLayerOps")
