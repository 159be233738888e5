"""`gguf_*` quant methods: GGUF checkpoints served from their integer blocks on the CPU.

Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K and Q6_K tensors stay packed (as many bytes as the
file; the default SmolLM2 Q4_1 is 4x fewer than fp32) and are multiplied by C kernels that
quantize the activations per block of 32 to integers and sum code x activation exactly. One
kernel source, registered per instruction set and activation width, so the resolver picks the
best this CPU has and says why the others do not fit:

    gguf_amx         gguf_avx512, except: AMX int8 tiles with the same int16-activation
                     arithmetic for bf16 inputs of 8+ rows and fp32 ones of 128+ (a
                     tile-ordered copy of the codes made at load: +0.5 byte a 4-bit
                     weight), AMX bf16 tiles for bf16 inputs of 128+ rows (the weights
                     dequantized inside the kernel)                         priority 50
    gguf_avx512      AVX-512 BW/VL + VNNI, int16 activations (vpdpwssd)   priority 40
    gguf_avx2        AVX2 + FMA + F16C, int16 activations (vpmaddwd)      priority 30
    gguf_c           portable C, int16 activations                        priority 20
    gguf_*_q8        the same with int8 activations (vpdpbusd / vpmaddubsw): llama.cpp's
                     arithmetic, faster, chosen only by name (--quantization gguf_avx512_q8)

int16 activations are the default: their rounding (2^-16 of a block's largest value) is below
bf16's, while int8's (llama.cpp's Q8 activations) turns SmolLM2's answer to "What is the
capital of France?" from Paris into something else, as it does under llama.cpp itself. All of
them beat `unquantized` (dense weights dequantized at load, priority 10), which
`--quantization unquantized` still selects. The kernels are compiled on first use with the
machine's C compiler (cached; kernels.py), so a CPU without one rejects these methods.
"""

from core.contract.capabilities import QuantCaps
from core.contract.hookspecs import hookimpl
from plugins._kit.cbuild import ISA_FEATURES

CORE_PLUGIN_API = ">=1.8,<2"

_COMMON = dict(
    devices={"cpu"},
    config_names={"gguf"},
    formats={"gguf"},
    # activations are fp32 or bf16 into the kernels (int8 per block inside)
    dtypes={"float32", "bfloat16"},
    programs=("cc",),
)

_M = "plugins.quant.gguf.method:"
# name -> (factory, ISA variant, priority (0: only by name), what)
VARIANTS = {
    "gguf_amx": (_M + "GGUFAmxMethod", "amx", 50,
                 "AMX int8 tiles (int16 activations) for 8+ rows of bf16 input and 128+ of "
                 "fp32, bf16 tiles for 128+ rows of bf16, AVX-512 VNNI int16 below"),
    "gguf_avx512": (_M + "GGUFAvx512Method", "avx512_vnni", 40,
                    "AVX-512 VNNI, int16 activations"),
    "gguf_avx2": (_M + "GGUFAvx2Method", "avx2", 30, "AVX2, int16 activations"),
    "gguf_c": (_M + "GGUFLinearMethod", "portable", 20, "portable C, int16 activations"),
    "gguf_avx512_q8": (_M + "GGUFAvx512Q8Method", "avx512_vnni", 0,
                       "AVX-512 VNNI, int8 activations (llama.cpp's arithmetic)"),
    "gguf_avx2_q8": (_M + "GGUFAvx2Q8Method", "avx2", 0,
                     "AVX2, int8 activations (llama.cpp's arithmetic)"),
    "gguf_c_q8": (_M + "GGUFPortableQ8Method", "portable", 0,
                  "portable C, int8 activations (llama.cpp's arithmetic)"),
}


@hookimpl
def core_register_quant_methods(register):
    for name, (factory, variant, prio, what) in VARIANTS.items():
        caps = dict(_COMMON)
        register(name, QuantCaps(cpu_isa=ISA_FEATURES[variant], priority={"cpu": prio},
                                 description=f"GGUF blocks kept, {what}; Q4_0/Q4_1/Q5_0/Q5_1/"
                                             f"Q8_0/Q4_K/Q5_K/Q6_K", **caps), factory)
