"""`flex_attention`: PyTorch FlexAttention over the paged KV cache, with block masks.

Declared here without importing anything heavy; the class lives in `backend.py`. Its limits are
real ones: each step gathers every request's K/V out of the pages into a padded batch (an extra
copy of the context per layer), masks are rebuilt per step, and neither the gather nor
FlexAttention's compiled kernel can be captured in a CUDA graph. On CUDA the kernel is compiled
with torch.compile (the first call of each shape family compiles for seconds). On CPU it runs
FlexAttention's eager, unfused path (scores materialised): correct, slow, and never preferred.
"""

import importlib.metadata

from packaging.version import InvalidVersion, Version

from core.contract.capabilities import AttentionCaps, PageSizes
from core.contract.hookspecs import hookimpl

CORE_PLUGIN_API = ">=1.0,<2"
MIN_TORCH = "2.5"


def _torch_ok() -> tuple[bool, str]:
    """Read torch's version from its metadata (not by importing it)."""
    try:
        found = importlib.metadata.version("torch")
        return Version(found).release >= Version(MIN_TORCH).release, found
    except (importlib.metadata.PackageNotFoundError, InvalidVersion):
        return False, "none"


def _caps() -> AttentionCaps:
    ok, found = _torch_ok()
    note = "" if ok else f"; DISABLED: needs torch >= {MIN_TORCH}, found {found}"
    return AttentionCaps(
        # With an old torch the backend declares no device, so every plan rejects it.
        devices={"cuda", "cpu"} if ok else set(),
        dtypes={"float16", "bfloat16", "float32"},
        # The gather dequantizes, so FP8 caches come for free.
        kv_cache_dtypes={"float16", "bfloat16", "float32", "fp8_e4m3", "fp8_e5m2"},
        head_sizes={64, 128},
        page_sizes=PageSizes.any(),
        attention_kinds={"MHA", "GQA", "MQA"},
        sliding_window=True,
        logit_softcap=True,
        sinks=False,
        phases={"prefill", "decode"},
        cuda_graph=False,  # per-step host work (masks, gathers) and a compiled kernel
        deterministic=True,
        requires=(),
        # For comparison: below triton on CUDA, below torch_native on CPU.
        priority={"cuda": 5, "cpu": 0},
        description=f"PyTorch FlexAttention (torch >= {MIN_TORCH}) over K/V gathered from the "
                    f"pages; compiled on CUDA, eager and unfused on CPU; no CUDA graphs{note}",
    )


CAPS = _caps()


@hookimpl
def core_register_attention_backends(register):
    register("flex_attention", CAPS, "plugins.attention.flex_attention.backend:FlexAttention")
