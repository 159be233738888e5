"""`triton_mla`: the MLA kind (core.contract.mla) in Triton over the paged latent pool.

Decode runs absorbed and split-KV (decode.py): q_nope through w_kc into the latent space, one
kernel program per (request, block of 16 heads, KV split) reading each latent row once for the
whole head block, a merge of the splits, then o_lat through w_vc. Extend (prefill, chunked
prefill, cached prefixes) runs materialised (extend.py): each request's latent expanded per
chunk of tokens, a flash-attention kernel carrying its softmax state across the chunks.

Declared here without importing triton; the class (`backend.py`) is imported only when chosen.
Under TRITON_INTERPRET=1 the same kernels run on CPU tensors (how CI tests them; not a serving
path, so "cpu" is not a declared device).
"""

from core.contract.capabilities import AttentionCaps, CapabilityRange, PageSizes
from core.contract.hookspecs import hookimpl

CORE_PLUGIN_API = ">=1.0,<2"

CAPS = AttentionCaps(
    devices={"cuda"},
    # tl.dot on bf16 needs Ampere
    capability={"cuda": CapabilityRange(min=80)},
    dtypes={"float32", "float16", "bfloat16"},
    # the latent row is stored as computed: no FP8 latent cache yet (refused at construction)
    kv_cache_dtypes={"float32", "float16", "bfloat16"},
    head_sizes=None,  # any latent width (kv_lora_rank + qk_rope_head_dim; 576 for DeepSeek)
    # slots are read token by token through req_to_token: pages are invisible to the kernels
    page_sizes=PageSizes.any(),
    attention_kinds={"MLA"},
    sliding_window=False,
    logit_softcap=False,
    sinks=False,
    phases={"prefill", "decode"},
    # Decode grids depend on the batch size, the head count and a split count fixed per
    # captured batch size (from the longest context a graph may see); seq lens stay on the
    # device. Extend sizes its launches from host lengths and is never captured.
    cuda_graph=True,
    # no atomics, but the decode split count follows the batch shape: not batch-invariant
    deterministic=False,
    requires=("triton",),
    priority={"cuda": 20},
    description="Triton MLA over the latent cache: absorbed split-KV decode (each latent row "
                "read once per 16 heads), materialised extend expanding the latent per chunk "
                "of prefix; no FP8 latent cache",
)


@hookimpl
def core_register_attention_backends(register):
    register("triton_mla", CAPS, "plugins.attention.triton_mla.backend:TritonMLA")
