"""The `torch_native` LoRA backend: the reference, two matmuls per adapter slot present in the
step with index_select / index_add over its tokens, in plain PyTorch on any device."""

from __future__ import annotations

from core.contract.capabilities import LoRACaps
from core.contract.hookspecs import hookimpl

CORE_PLUGIN_API = ">=1.10,<2"

CAPS = LoRACaps(
    devices=("cuda", "rocm", "xpu", "npu", "cpu"), max_rank=512, graph_safe=False,
    quant_methods=("unquantized", "gguf_c", "gguf_avx2", "gguf_avx512", "gguf_amx", "gguf_c_q8",
                   "gguf_avx2_q8", "gguf_avx512_q8", "awq", "gptq", "fp8", "w8a8_int8"),
    tensor_parallel=True,  # per-rank buffers are the base layers' splits (core.engine.lora)
    priority={"cpu": 10, "cuda": 1, "rocm": 1, "xpu": 1, "npu": 1},
    description="reference: per adapter slot in the step, gather its tokens, x @ A^T @ B^T per "
                "output slice, scatter-add (PyTorch, any device)")


@hookimpl
def core_register_lora_backends(register):
    register("torch_native", CAPS, "plugins.lora.torch_native.backend:TorchNativeLoRA")
