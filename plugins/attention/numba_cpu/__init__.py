"""`numba_cpu` attention: decode over the paged KV cache with a Numba kernel, for CPUs.

Decode reads each request's K/V rows straight from the pool (kernels.py); prefill / extend is
torch_native's (SDPA per request), which is already at the CPU's matmul rate. Declared here
without importing numba; the class lives in `backend.py`, imported only when this backend is
chosen. Preferred over torch_native on CPUs when numba is installed.
"""

from core.contract.capabilities import AttentionCaps, PageSizes
from core.contract.hookspecs import hookimpl

CORE_PLUGIN_API = ">=1.0,<2"

CAPS = AttentionCaps(
    devices={"cpu"},
    # Compute and softmax in fp32; the pool is read as fp32 or as bf16 bit patterns.
    dtypes={"float32", "bfloat16"},
    kv_cache_dtypes={"float32", "bfloat16"},
    head_sizes=None,
    page_sizes=PageSizes.any(),
    attention_kinds={"MHA", "GQA", "MQA"},
    sliding_window=True,
    logit_softcap=True,
    sinks=False,
    phases={"prefill", "decode"},
    cuda_graph=False,
    # One thread per request, a fixed summation order: batch-invariant and run-to-run stable.
    deterministic=True,
    requires=("numba",),
    priority={"cpu": 20},
    description="Numba CPU decode straight from the paged KV pool (fp32 / bf16 storage); "
                "prefill as torch_native",
)


@hookimpl
def core_register_attention_backends(register):
    register("numba_cpu", CAPS, "plugins.attention.numba_cpu.backend:NumbaCpuAttention")
