"""bench/bench_moe.py's torch._grouped_mm peer computes the MoE layer the reference runner does
(on the CPU, where torch has a grouped_mm fallback), so its GPU timings compare like with like."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))

from bench_moe import grouped_mm_moe  # noqa: E402

from core.contract.moe import MoELayerParams, MoEWeights  # noqa: E402
from plugins.moe.torch_native.runner import TorchNativeMoE  # noqa: E402


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="this torch has no _grouped_mm")
@pytest.mark.parametrize(("experts", "top_k", "tokens"), [(8, 2, 5), (16, 4, 33), (8, 8, 1)])
def test_grouped_mm_peer_matches_torch_native(experts, top_k, tokens):
    g = torch.Generator().manual_seed(experts + tokens)
    H, inter = 64, 32
    x = torch.randn(tokens, H, generator=g, dtype=torch.bfloat16)
    logits = torch.randn(tokens, experts, generator=g, dtype=torch.bfloat16)
    if tokens > 4:
        logits[:, 0] += 100.0  # every token on expert 0 (others then see few or none)
    w = MoEWeights(torch.randn(experts, 2 * inter, H, generator=g, dtype=torch.bfloat16) / 8,
                   torch.randn(experts, H, inter, generator=g, dtype=torch.bfloat16) / 6)
    layer = MoELayerParams(0, experts, top_k, H, inter)
    try:
        out = grouped_mm_moe(x, logits, w, layer)
    except (RuntimeError, NotImplementedError) as exc:  # a torch without the CPU fallback
        pytest.skip(f"torch._grouped_mm does not run on this CPU: {exc}")
    ref = TorchNativeMoE().forward(x, logits, w, layer)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    torch.testing.assert_close(out.float(), ref.float(), atol=3e-2, rtol=3e-2)
    # the peer is not trivially equal to anything: a wrong routing weight moves it
    w2 = MoEWeights(w.w13, w.w2 * 2)
    assert (grouped_mm_moe(x, logits, w2, layer).float() - ref.float()).abs().max() > 0.1
