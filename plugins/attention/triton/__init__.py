"""`triton` attention: Triton kernels over the paged KV cache.

Declared here without importing triton; the kernels live in `decode.py` / `extend.py` and the
class in `backend.py`, imported only when this backend is chosen. Under TRITON_INTERPRET=1 the
same kernels run on CPU tensors (that is how CI tests them; it is not a serving path, so "cpu" is
not a declared device).
"""

from core.contract.capabilities import AttentionCaps, CapabilityRange, PageSizes
from core.contract.hookspecs import hookimpl

CORE_PLUGIN_API = ">=1.0,<2"

CAPS = AttentionCaps(
    devices={"cuda", "rocm"},
    # tl.dot on bf16 needs Ampere.
    capability={"cuda": CapabilityRange(min=80)},
    dtypes={"float16", "bfloat16", "float32"},
    kv_cache_dtypes={"float16", "bfloat16", "float32", "fp8_e4m3", "fp8_e5m2"},
    head_sizes={32, 64, 80, 96, 128, 256},
    # Slots are read token by token through req_to_token: pages are invisible to the kernels.
    page_sizes=PageSizes.any(),
    attention_kinds={"MHA", "GQA", "MQA"},
    sliding_window=True,
    logit_softcap=True,
    sinks=True,
    phases={"prefill", "decode"},
    # Decode has static shapes: the grid depends on the batch size and a split count fixed per
    # captured batch size (from the longest context a graph may see); seq lens stay on the
    # device, nothing syncs with the host. (Extend sizes its grid from host lengths; it is
    # never captured.)
    cuda_graph=True,
    verify_rows=True,  # every row's K/V is stored before any row attends
    # Run-to-run deterministic in one process (no atomics), but the extend tiling may be
    # autotuned per process (CORE_TRITON_AUTOTUNE=1) and the decode split count follows the batch
    # shape and longest context: not batch-invariant.
    deterministic=False,
    requires=("triton",),
    # Triton converts FP8 with cvt.e4m3x2/e5m2x2, which ptxas accepts from sm89 ("fp8" feature)
    kv_cache_dtype_features={"fp8_e4m3": {"fp8"}, "fp8_e5m2": {"fp8"}},
    priority={"cuda": 20, "rocm": 20},
    description="Triton paged attention: split-KV decode + prefix/causal extend, GQA/MQA, "
                "sliding window, soft-cap, FP8 KV (sm89+); ROCm declared but "
                "untested",
)


@hookimpl
def core_register_attention_backends(register):
    register("triton", CAPS, "plugins.attention.triton.backend:TritonAttention")
