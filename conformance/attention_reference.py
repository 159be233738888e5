"""The fp32 ground truth the conformance suite measures every backend against (torch_native too).

Written independently of any backend: it reads each request's K/V from the pool through the
request-to-token table, dequantizes, and does masked softmax attention in fp32, query rows in
chunks so that full-size cases fit in memory.
"""

from __future__ import annotations

import torch

from core.contract.attention import AttentionLayerParams
from core.contract.forward_batch import ForwardBatch

_ROWS_PER_CHUNK = 256


def reference_attention(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor,
                        layer: AttentionLayerParams, batch: ForwardBatch,
                        k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """q [T, H*D] against the pool's K/V (already holding this step's tokens) -> [T, H*Dv] fp32.

    Query t of request i sits at position prefix_i + j and sees keys at positions p with
    p <= prefix_i + j and, with a window w, p > prefix_i + j - w. With sinks, head h's sink
    logit joins each of its rows' softmax as one more score whose value is zero.
    """
    H, Hkv, D = layer.num_heads, layer.num_kv_heads, layer.head_dim
    Dv = layer.v_head_dim or D
    group = H // Hkv
    T = q.shape[0]
    qf = q.float().view(T, H, D)
    out = torch.empty(T, H, Dv, dtype=torch.float32, device=q.device)
    start = 0
    rows = batch.req_pool_indices.tolist()
    for i, seq_len in enumerate(batch.seq_lens_cpu):
        n = 1 if batch.is_decode else batch.extend_lens_cpu[i]
        prefix = seq_len - n
        slots = batch.req_to_token[rows[i], :seq_len].long()
        # [L, Hkv, D] -> [H, L, D]: each KV head serves `group` consecutive query heads.
        k = (k_buf[slots].float() * k_scale).repeat_interleave(group, dim=1).transpose(0, 1)
        v = (v_buf[slots].float() * v_scale).repeat_interleave(group, dim=1).transpose(0, 1)
        key_pos = torch.arange(seq_len, device=q.device)
        for c0 in range(0, n, _ROWS_PER_CHUNK):
            c1 = min(n, c0 + _ROWS_PER_CHUNK)
            qc = qf[start + c0:start + c1].transpose(0, 1)  # [H, c, D]
            s = torch.matmul(qc, k.transpose(1, 2)) * layer.scaling  # [H, c, L]
            if layer.logit_softcap:
                s = torch.tanh(s / layer.logit_softcap) * layer.logit_softcap
            q_pos = prefix + torch.arange(c0, c1, device=q.device)[:, None]
            visible = key_pos[None, :] <= q_pos  # [c, L]
            if layer.sliding_window:
                visible &= key_pos[None, :] > q_pos - layer.sliding_window
            s = s.masked_fill(~visible, float("-inf"))
            if layer.sinks is not None:  # one more column per head, dropped after the softmax
                sink = layer.sinks.float().to(q.device).view(H, 1, 1).expand(H, c1 - c0, 1)
                p = torch.softmax(torch.cat([s, sink], dim=-1), dim=-1)[..., :-1]
            else:
                p = torch.softmax(s, dim=-1)
            out[start + c0:start + c1] = torch.matmul(p, v).transpose(0, 1)
        start += n
    return out.view(T, H * Dv)
