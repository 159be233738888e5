"""`torch_native_mla`: the MLA kind's reference backend (core.contract.mla), pure PyTorch over the
latent cache, on any torch device: materialised attention for extend (prefill, chunks, cached
prefixes), absorbed attention for decode. Declared here; the class (`backend.py`) is imported only
when it is chosen.
"""

from core.contract.capabilities import AttentionCaps, PageSizes
from core.contract.hookspecs import hookimpl

CORE_PLUGIN_API = ">=1.0,<2"

CAPS = AttentionCaps(
    devices={"cuda", "rocm", "xpu", "npu", "cpu"},
    dtypes={"float32", "float16", "bfloat16"},
    # the latent row is stored as computed; no FP8 latent cache yet
    kv_cache_dtypes={"float32", "float16", "bfloat16"},
    head_sizes=None,  # any latent width (kv_lora_rank + qk_rope_head_dim; 576 for DeepSeek)
    page_sizes=PageSizes.any(),
    attention_kinds={"MLA"},
    sliding_window=False,
    logit_softcap=False,
    sinks=False,
    phases={"prefill", "decode"},
    cuda_graph=False,  # per-request Python loops, as torch_native
    deterministic=True,
    priority={"cpu": 10, "cuda": 1, "rocm": 1, "xpu": 1, "npu": 1},
    description="pure PyTorch MLA over the latent cache: materialised extend, absorbed decode "
                "(reference backend)",
)


@hookimpl
def core_register_attention_backends(register):
    register("torch_native_mla", CAPS,
             "plugins.attention.torch_native_mla.backend:TorchNativeMLA")
