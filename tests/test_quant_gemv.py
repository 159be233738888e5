"""The one-row (batch-1 decode) W8A8 kernel of plugins/_kit/w8a8_triton.py under the Triton
interpreter, against the fp32 product of the same quantized operands: int8 weights with
per-token and static activation scales (and the FBGEMM clamp), fp16 standing in for e4m3 (the
interpreter has no fp8) with per-channel and 128-wide block scales, split K, ragged N and K;
the 16-row tl.dot kernel on the same inputs must agree. On a GPU see tests/test_quant_gpu.py."""

from __future__ import annotations

import textwrap

import pytest
from interpreted import run_interpreted

_SCRIPT = textwrap.dedent("""
    import torch
    from plugins._kit.w8a8_triton import small_m_linear
    torch.manual_seed(0)

    def rel(y, ref):
        return ((y.float() - ref).norm() / ref.norm()).item()

    configs = [None, dict(kernel="gemv", BLOCK_N=16, BLOCK_K=256, num_warps=4, per_sm=4),
               dict(kernel="gemv", BLOCK_N=8, BLOCK_K=128, num_warps=2, SPLIT_K=3, per_sm=1),
               dict(kernel="dot")]
    # int8 per channel: per token (with bias), static, and clamped per token
    n, k = 80, 1000  # N not a multiple of the tiles, K not of the steps
    w = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    ws = torch.rand(n, 1) + 0.01
    bias = torch.randn(n)
    for cfg in configs:
        x = torch.randn(1, k)
        xs = x.abs().amax(1, keepdim=True) / 127
        xd = torch.round(x / xs).clamp(-127, 127) * xs
        y = small_m_linear(x, w, ws, bias, "token", config=cfg)
        assert rel(y, xd @ (w.float() * ws).t() + bias) < 1e-5, cfg
        y = small_m_linear(x, w, ws, None, "static", input_scale=torch.tensor(0.05), config=cfg)
        xd = torch.round(x / 0.05).clamp(-127, 127) * 0.05
        assert rel(y, xd @ (w.float() * ws).t()) < 1e-5, cfg
        # fp16 weights as e4m3, the amax clamped (FBGEMM's activation_scale_ub)
        y = small_m_linear(x, w.half(), ws, None, "token", ub=torch.tensor([[1.0]]), config=cfg)
        s = x.abs().amax(1, keepdim=True).clamp(max=1.0) / 448
        xd = (x / s).clamp(-448, 448).half().float() * s
        assert rel(y, xd @ (w.half().float() * ws).t()) < 1e-5, cfg
    # block weights (32 x 128 blocks) with per-group activations, fp16 as e4m3
    w = torch.randn(96, 384).half()
    wsb = torch.rand(3, 3) + 0.5
    ew = wsb.repeat_interleave(32, 0).repeat_interleave(128, 1)
    for cfg in [None, dict(kernel="gemv", BLOCK_N=16, num_warps=2, per_sm=2),
                dict(kernel="gemv", BLOCK_N=64), dict(kernel="dot")]:  # 64 > 32: dot kernel
        x = torch.randn(1, 384)
        xg = x.view(1, 3, 128)
        sg = xg.abs().amax(-1, keepdim=True) / 448
        xd = ((xg / sg).half().float() * sg).view(1, 384)
        y = small_m_linear(x, w, wsb, None, "group", (32, 128), config=cfg)
        assert rel(y, xd @ (w.float() * ew).t()) < 1e-5, cfg
    print("ok")
""")


def test_one_row_w8a8_kernel_under_the_interpreter():
    pytest.importorskip("triton")
    run_interpreted(_SCRIPT)
