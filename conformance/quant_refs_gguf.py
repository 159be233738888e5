"""GGUF reference cases for the quant suite: weights quantized and dequantized by the `gguf`
package (llama.cpp's own Python reference of its block formats), independent of any method.

A case's projection is one GGUFBlocks tensor (core.engine.gguf_weights: GGML type name, raw
block bytes, logical shape), what the GGUF loader hands a method; its reference is the gguf
package's dequantization of those bytes. GGUF methods quantize activations per block of 32 on
their own (llama.cpp's int8 "Q8" activations, or finer): the reference takes x as it is and the
case's slack is twice what int8 per-block quantization of these very activations costs
(`q8_slack`), so an int8-activation method passes and a wrong scale, layout or shard order
(off by ~1) does not. The checkpoint test skips GGUF cases: their checkpoint is one .gguf file,
which the suite does not write (tests/test_gguf_*.py load real ones)."""

from __future__ import annotations

import numpy as np
import torch

from conformance.quant_refs import RefCase, _rel_err

# the types the gguf package quantizes in Python (the K-quants it only dequantizes)
TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")
CONFIG = {"quant_method": "gguf"}
NO_CHECKPOINT = "gguf-file"  # tag: the checkpoint test does not apply


def q8_blocks(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] -> fp32 x rounded per block of 32 to int8 with amax / 127 scales (llama.cpp's
    Q8 activations; K a multiple of 32)."""
    m, k = x.shape
    b = x.float().reshape(m, k // 32, 32)
    s = b.abs().amax(-1, keepdim=True).clamp(min=1e-30) / 127.0
    return (torch.round(b / s).clamp(-127, 127) * s).reshape(m, k)


def q8_slack(x: torch.Tensor, w: torch.Tensor) -> float:
    x, w = x.float(), w.float()
    return 2.0 * _rel_err(q8_blocks(x) @ w.t(), x @ w.t())


def _build(type_name: str):
    def build(w: torch.Tensor):
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize, quantize

        from core.engine.gguf_weights import GGUFBlocks

        qt = GGMLQuantizationType[type_name]
        raw = quantize(w.float().numpy().astype(np.float32), qt)
        deq = torch.from_numpy(np.ascontiguousarray(dequantize(raw, qt), dtype=np.float32))
        return {"weight": GGUFBlocks(type_name, raw, tuple(w.shape))}, deq.reshape(w.shape)
    return build


CASES = tuple(RefCase(f"gguf-{t.lower()}", "gguf", CONFIG, _build(t), "none", k_multiple=32,
                      n_multiple=16, tags=(NO_CHECKPOINT,), slack=q8_slack) for t in TYPES)
