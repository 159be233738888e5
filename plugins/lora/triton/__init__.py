"""`triton` LoRA backend: segmented shrink (x @ A^T per adapter) and expand (@ B^T, scaled,
added into each output slice of a fused projection) Triton kernels.

Declared here without importing triton; the kernels live in `kernels.py` and the class in
`backend.py`, imported only when this backend is chosen. Under TRITON_INTERPRET=1 the same
kernels run on CPU tensors (how CI tests them, fp32 and fp16; the interpreter computes bf16 dots
wrongly, so bf16 is a GPU check): not a serving path, so "cpu" is not a declared device.
"""

from core.contract.capabilities import CapabilityRange, LoRACaps
from core.contract.hookspecs import hookimpl

CORE_PLUGIN_API = ">=1.10,<2"

CAPS = LoRACaps(
    devices={"cuda"},
    capability={"cuda": CapabilityRange(min=80)},  # tl.dot on bf16 needs Ampere
    dtypes={"float16", "bfloat16", "float32"},
    max_rank=64,  # what its conformance run covers (8 to 64)
    # Steps of up to DECODE_TOKENS tokens (decode) and device-only steps of any size (a decode
    # graph's bucket) are served from a block table the backend derives on the device from the
    # batch's device tensors (each token's slot by searchsorted over seg_indptr, the tokens
    # grouped by slot): no host list is read, no sync, and the launch grids depend on the token
    # and slot counts alone. Longer eager steps (prefill) use host-built segment blocks.
    graph_safe=True,
    # the delta is added to whatever the base computed: the CUDA quant methods' outputs
    quant_methods={"unquantized", "fp8", "w8a8_int8", "awq", "gptq"},
    tensor_parallel=True,  # per-rank buffers are the base layers' splits (core.engine.lora)
    requires=("triton",),
    priority={"cuda": 20},
    description="Triton segmented shrink (x @ A^T) and expand (scaled @ B^T into each output "
                "slice); decode steps grouped by adapter on the device",
)


@hookimpl
def core_register_lora_backends(register):
    register("triton", CAPS, "plugins.lora.triton.backend:TritonLoRA")
