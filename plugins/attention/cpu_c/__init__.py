"""`cpu_c*` attention: decode over the paged KV pool with a C kernel (attn.c), for CPUs.

Decode reads each request's K/V rows straight from the pool, one work item per (request, KV
head) over OpenMP threads; prefill / extend is torch_native's. The same source built per
instruction set (plugins/_kit/cbuild.py): `cpu_c_avx512`, `cpu_c_avx2`, `cpu_c`; ahead of
numba_cpu, whose per-call dispatch (~25 us) is most of a small model's decode attention. Needs a
C compiler.

`cpu_amx` (amx.py, attn_amx.c): for Xeons with AMX computing in bf16, extends longer than
SHORT_EXTEND as flash attention on AMX bf16 tiles from the pool; decode and short extends as
cpu_c_avx512, fp32 extends (and head dims not a multiple of 32) as torch_native. Its source
builds with emulated tiles too (tests, any CPU). Opt-in (`--attention-backend cpu_amx`; priority
below cpu_c_avx512): right on an AMX CPU, but slower there than torch_native's extend at most
shapes (the registration says where).

`cpu_c_mla*` (mla.py): the MLA kind with the same kernel at decode, absorbed over the latent pool
(one KV head of width kv_lora_rank + rope dims, all query heads on each row read once); extend is
torch_native_mla's materialised form.
"""

from core.contract.capabilities import AttentionCaps, PageSizes
from core.contract.hookspecs import hookimpl
from plugins._kit.cbuild import ISA_FEATURES

CORE_PLUGIN_API = ">=1.4,<2"

VARIANTS = {
    "cpu_c_avx512": ("plugins.attention.cpu_c.backend:CpuCAttentionAvx512", "avx512_vnni", 40),
    "cpu_c_avx2": ("plugins.attention.cpu_c.backend:CpuCAttentionAvx2", "avx2", 35),
    "cpu_c": ("plugins.attention.cpu_c.backend:CpuCAttention", "portable", 30),
}


MLA_VARIANTS = {
    "cpu_c_mla_avx512": ("plugins.attention.cpu_c.mla:CpuCMLAAvx512", "avx512_vnni", 25),
    "cpu_c_mla_avx2": ("plugins.attention.cpu_c.mla:CpuCMLAAvx2", "avx2", 20),
    "cpu_c_mla": ("plugins.attention.cpu_c.mla:CpuCMLA", "portable", 15),
}


@hookimpl
def core_register_attention_backends(register):
    register("cpu_amx", AttentionCaps(
        devices={"cpu"}, cpu_isa=ISA_FEATURES["amx"],
        dtypes={"float32", "bfloat16"}, kv_cache_dtypes={"float32", "bfloat16"},
        head_sizes=None, page_sizes=PageSizes.any(),
        attention_kinds={"MHA", "GQA", "MQA"}, sliding_window=True, logit_softcap=True,
        sinks=False, phases={"prefill", "decode"}, cuda_graph=True,  # decode is cpu_c's
        # fixed work items, each a fixed summation order. Below cpu_c_avx512 (40), so opt-in
        # (--attention-backend cpu_amx): on a 16-core Xeon with AMX (session 22) its tiles are
        # right (`bench/bench_cpu_amx_attention.py --check`, the tile tests) but slower than
        # torch_native's extend at 16 threads, whose SDPA already reaches 800-1750 GFLOP/s
        # there: 3.18x faster only for SmolLM2's shape at a 512-token prompt, 0.49-0.87x at
        # 4096 tokens, over a 3584-token prefix and for Llama-8B's heads (bench/RESULTS.md)
        deterministic=True, programs=("cc",), priority={"cpu": 38},
        description="bf16 extend as flash attention on AMX tiles from the paged KV pool; "
                    "decode and short extends as cpu_c_avx512; fp32 extend as torch_native"),
        "plugins.attention.cpu_c.amx:CpuAmxAttention")
    for name, (factory, variant, prio) in VARIANTS.items():
        register(name, AttentionCaps(
            devices={"cpu"}, cpu_isa=ISA_FEATURES[variant],
            dtypes={"float32", "bfloat16"}, kv_cache_dtypes={"float32", "bfloat16"},
            head_sizes=None, page_sizes=PageSizes.any(),
            attention_kinds={"MHA", "GQA", "MQA"}, sliding_window=True, logit_softcap=True,
            # decode graphs: on the CPU (plugins/hardware/cpu_graphs.py), its decode reads the
            # static table through ca_decode_tab, a NativeFn
            sinks=False, phases={"prefill", "decode"}, cuda_graph=True,
            verify_rows=True,  # every row's K/V is stored before any row attends
            # one work item per (request, KV head), a fixed summation order
            deterministic=True, programs=("cc",), priority={"cpu": prio},
            description=f"C decode straight from the paged KV pool ({variant} build); prefill "
                        f"as torch_native"), factory)
    for name, (factory, variant, prio) in MLA_VARIANTS.items():
        register(name, AttentionCaps(
            devices={"cpu"}, cpu_isa=ISA_FEATURES[variant],
            dtypes={"float32", "bfloat16"}, kv_cache_dtypes={"float32", "bfloat16"},
            head_sizes=None, page_sizes=PageSizes.any(), attention_kinds={"MLA"},
            sliding_window=False, logit_softcap=False, sinks=False,
            phases={"prefill", "decode"}, cuda_graph=False,
            # one work item per request, all heads at once, a fixed summation order
            deterministic=True, programs=("cc",), priority={"cpu": prio},
            description=f"MLA decode absorbed over the latent pool in C ({variant} build); "
                        f"extend materialised as torch_native_mla"), factory)
