"""`torch_native` attention: pure PyTorch over the paged KV cache, on any torch device.

The reference every other attention backend is tested against. Declared here; the class
(plugins/_kit/torch_attention.py, which cpu_c and numba_cpu build on) is imported through
`backend.py` only when this backend is chosen.
"""

from core.contract.capabilities import AttentionCaps, PageSizes
from core.contract.hookspecs import hookimpl

CORE_PLUGIN_API = ">=1.0,<2"

CAPS = AttentionCaps(
    devices={"cuda", "rocm", "xpu", "npu", "cpu"},
    dtypes={"float32", "float16", "bfloat16"},
    kv_cache_dtypes={"float32", "float16", "bfloat16"},
    head_sizes=None,
    page_sizes=PageSizes.any(),
    attention_kinds={"MHA", "GQA", "MQA"},
    sliding_window=True,
    logit_softcap=True,
    sinks=True,
    phases={"prefill", "decode"},
    # Like SGLang's torch_native: per-request Python loops cannot be captured in a CUDA graph.
    cuda_graph=False,
    verify_rows=True,  # every row's K/V is stored before any row attends
    deterministic=True,
    priority={"cpu": 10, "cuda": 1, "rocm": 1, "xpu": 1, "npu": 1},
    description="pure PyTorch SDPA over the paged KV cache (reference backend)",
)


@hookimpl
def core_register_attention_backends(register):
    register("torch_native", CAPS, "plugins.attention.torch_native.backend:TorchNativeAttention")
