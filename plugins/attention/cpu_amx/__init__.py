"""`cpu_amx` attention: prefill / extend on Intel AMX bf16 tiles (attn_amx.c), decode and short
extends (speculative verify) on cpu_c_avx512's C kernel. For Xeons with AMX (Sapphire Rapids
and later) computing in bf16; fp32 extends, non-bf16 KV caches and head dims that are not
multiples of 32 take torch_native's extend path (see backend.py). Needs a C compiler."""

from core.contract.capabilities import AttentionCaps, PageSizes
from core.contract.hookspecs import hookimpl
from plugins._kit.cbuild import ISA_FEATURES

CORE_PLUGIN_API = ">=1.4,<2"


@hookimpl
def core_register_attention_backends(register):
    register("cpu_amx", AttentionCaps(
        devices={"cpu"}, cpu_isa=ISA_FEATURES["amx"],
        dtypes={"float32", "bfloat16"}, kv_cache_dtypes={"float32", "bfloat16"},
        head_sizes=None, page_sizes=PageSizes.any(),
        attention_kinds={"MHA", "GQA", "MQA"}, sliding_window=True, logit_softcap=True,
        sinks=False, phases={"prefill", "decode"}, cuda_graph=False,
        # fixed work items, each a fixed summation order
        deterministic=True, programs=("cc",), priority={"cpu": 45},
        description="bf16 extend as flash attention on AMX tiles from the paged KV pool; "
                    "decode and short extends as cpu_c_avx512; fp32 extend as torch_native"),
        "plugins.attention.cpu_amx.backend:CpuAmxAttention")
