"""`example_sdpa`: attention over the paged KV cache through torch's scaled_dot_product_attention.

Imported only when the resolver chooses `example_sdpa` (the plugin declares it as
"core_example_backend.backend:ExampleSDPAAttention"). It computes what the built-in torch_native
reference computes; the point of the example is the packaging and the capabilities, not speed:
one SDPA call per request, so it is not CUDA-graph safe (and its caps say so).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from core.contract.attention import AttentionBackend, AttentionLayerParams, BackendContext
from core.contract.forward_batch import ForwardBatch


@dataclass(frozen=True)
class _Request:
    q_start: int  # first row of this request's new tokens in q
    q_len: int  # new tokens this step (1 in decode)
    slots: torch.Tensor  # [seq_len] int64 KV slots of every token of the request
    mask: torch.Tensor | None  # [q_len, seq_len] bool, True = may attend; None = attend to all


@dataclass(frozen=True)
class SDPAMeta:
    """Per-step metadata, built once by `prepare` and shared by every layer."""

    requests: tuple[_Request, ...]


class ExampleSDPAAttention(AttentionBackend):
    """Per-request SDPA over the paged KV cache. MHA/GQA/MQA; no sliding window, no soft-cap."""

    def __init__(self, ctx: BackendContext):
        super().__init__(ctx)
        if ctx.head_dim not in (64, 128):
            raise ValueError(f"example_sdpa supports head sizes 64 and 128, not {ctx.head_dim}")

    def prepare(self, batch: ForwardBatch) -> SDPAMeta:
        device = batch.req_to_token.device
        requests = []
        q_start = 0
        for i, seq_len in enumerate(batch.seq_lens_cpu):
            q_len = 1 if batch.is_decode else batch.extend_lens_cpu[i]
            row = int(batch.req_pool_indices[i])
            slots = batch.req_to_token[row, :seq_len].to(torch.int64)
            mask = None
            if q_len > 1:
                # Causal over the whole sequence: query j sits at position seq_len - q_len + j.
                # SDPA's is_causal aligns the mask top-left, which is wrong once a cached prefix
                # makes seq_len > q_len, so the mask is explicit.
                q_pos = torch.arange(seq_len - q_len, seq_len, device=device)
                k_pos = torch.arange(seq_len, device=device)
                mask = k_pos[None, :] <= q_pos[:, None]  # [q_len, seq_len]
            requests.append(_Request(q_start, q_len, slots, mask))
            q_start += q_len
        return SDPAMeta(tuple(requests))

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                layer: AttentionLayerParams, batch: ForwardBatch) -> torch.Tensor:
        # The resolver never picks this backend for such layers; refuse rather than ignore them.
        if layer.sliding_window is not None:
            raise ValueError(f"example_sdpa does not support sliding window attention "
                             f"(layer {layer.layer_id} has window {layer.sliding_window})")
        if layer.logit_softcap is not None:
            raise ValueError(f"example_sdpa does not support logit soft-capping "
                             f"(layer {layer.layer_id} has soft-cap {layer.logit_softcap})")
        meta = batch.attn_meta if isinstance(batch.attn_meta, SDPAMeta) else self.prepare(batch)

        num_tokens = q.shape[0]
        heads, kv_heads = layer.num_heads, layer.num_kv_heads
        head_dim, v_dim = layer.head_dim, layer.v_head_dim or layer.head_dim
        q = q.view(num_tokens, heads, head_dim)
        batch.kv_pool.set_kv(layer.layer_id, batch.out_cache_loc,
                             k.view(num_tokens, kv_heads, head_dim),
                             v.view(num_tokens, kv_heads, v_dim))
        k_buf, v_buf = batch.kv_pool.get_kv_buffer(layer.layer_id)

        out = q.new_empty(num_tokens, heads, v_dim)
        group = heads // kv_heads
        for req in meta.requests:
            rows = slice(req.q_start, req.q_start + req.q_len)
            qi = q[rows].transpose(0, 1)  # [heads, q_len, head_dim]
            ki = k_buf[req.slots].to(q.dtype).transpose(0, 1)  # [kv_heads, seq_len, head_dim]
            vi = v_buf[req.slots].to(q.dtype).transpose(0, 1)  # [kv_heads, seq_len, v_dim]
            if group > 1:  # GQA/MQA: each KV head serves `group` consecutive query heads
                ki = ki.repeat_interleave(group, dim=0)
                vi = vi.repeat_interleave(group, dim=0)
            oi = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=req.mask,
                                                scale=layer.scaling)
            out[rows] = oi.transpose(0, 1)  # [q_len, heads, v_dim]
        return out.reshape(num_tokens, heads * v_dim)
