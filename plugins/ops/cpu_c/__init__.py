"""`cpu_c*` layer ops: the fused element-wise ops in C for CPUs (ops.c, built on first use).

One source compiled per instruction set (plugins/_kit/cbuild.py); the resolver takes the best
variant this CPU has: `cpu_c_avx512` (AVX-512), `cpu_c_avx2`, `cpu_c` (portable), all ahead of
the `torch` reference on a CPU. A CPU without a C compiler rejects them (the `torch` ops run).
"""

from core.contract.capabilities import LayerOpsCaps
from core.contract.hookspecs import hookimpl
from plugins._kit.cbuild import ISA_FEATURES

CORE_PLUGIN_API = ">=1.4,<2"

VARIANTS = {
    "cpu_c_avx512": ("plugins.ops.cpu_c.ops:CpuLayerOpsAvx512", "avx512_vnni", 40),
    "cpu_c_avx2": ("plugins.ops.cpu_c.ops:CpuLayerOpsAvx2", "avx2", 30),
    "cpu_c": ("plugins.ops.cpu_c.ops:CpuLayerOps", "portable", 20),
}


@hookimpl
def core_register_layer_ops(register):
    for name, (factory, variant, prio) in VARIANTS.items():
        register(name, LayerOpsCaps(
            devices={"cpu"}, cpu_isa=ISA_FEATURES[variant], dtypes={"float32", "bfloat16"},
            ops={"rms_norm", "add_rms_norm", "silu_and_mul", "rotary_qk", "store_kv"},
            # decode graphs on the CPU: every call is a NativeFn (core.contract.native)
            programs=("cc",), priority={"cpu": prio}, cuda_graph=True,
            description=f"C element-wise ops, {variant} build (one call per op)"), factory)
