"""`flex_attention` backend: FlexAttention over K/V gathered from the paged cache.

Layout per step: requests become batch rows. Queries are scattered into [B, H, Qmax, D] (Qmax =
1 in decode), each request's K/V slots are gathered into [B, Hkv, Lmax, D], and one block mask
says which (query, key) pairs exist: key j of request b is visible to its query i when
j < seq_len[b], j <= prefix[b] + i (causal) and, with a window, j > prefix[b] + i - window.
Padded keys are zeroed after the gather: a masked score weighs 0, but 0 * NaN is still NaN, and
padding slots may hold anything.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from core.contract.attention import AttentionBackend, AttentionLayerParams, BackendContext
from core.contract.forward_batch import ForwardBatch
from plugins.attention.flex_attention import MIN_TORCH, _torch_ok


@functools.lru_cache(maxsize=1)
def _compiled_flex():
    # dynamic=True: decode shapes change every step (the context grows); one graph serves them.
    return torch.compile(flex_attention, dynamic=True)


@dataclass
class FlexMeta:
    """Per-step metadata shared by every layer (masks are built lazily, one per window)."""

    decode: bool
    slots: torch.Tensor  # [B, Lmax] int64 slot of each request's key j (padding: slot 0)
    key_valid: torch.Tensor  # [B, Lmax] bool j < seq_len
    seq_lens: torch.Tensor  # [B] int32 (device)
    prefix_lens: torch.Tensor  # [B] int32 (device)
    token_req: torch.Tensor  # [T] int64 request of each new token
    token_pos: torch.Tensor  # [T] int64 index of the token among its request's new tokens
    q_len: int  # Qmax
    masks: dict = field(default_factory=dict)  # window (or None) -> BlockMask


class FlexAttention(AttentionBackend):
    """FlexAttention per step over a padded batch: MHA/GQA/MQA, sliding window, soft-cap."""

    def __init__(self, ctx: BackendContext):
        super().__init__(ctx)
        ok, found = _torch_ok()
        if not ok:
            raise RuntimeError(f"flex_attention needs torch >= {MIN_TORCH}, found {found}")
        # Eager FlexAttention on CUDA materialises the scores; compile it there.
        self._flex = _compiled_flex() if ctx.device.type == "cuda" else flex_attention

    def prepare(self, batch: ForwardBatch) -> FlexMeta:
        device = batch.req_to_token.device
        seq = list(batch.seq_lens_cpu)
        if batch.is_decode:
            ext = [1] * len(seq)
        else:
            ext = list(batch.extend_lens_cpu)
        prefix = [s - n for s, n in zip(seq, ext, strict=True)]
        L = max(seq, default=0)
        slots = batch.req_to_token[batch.req_pool_indices, :L].long()  # [B, L]
        seq_t = torch.tensor(seq, dtype=torch.int32, device=device)
        key_valid = torch.arange(L, device=device)[None, :] < seq_t[:, None]
        token_req = torch.repeat_interleave(torch.arange(len(seq), device=device),
                                            torch.tensor(ext, device=device))
        starts = torch.tensor([0] + ext[:-1], device=device).cumsum(0)
        token_pos = torch.arange(int(sum(ext)), device=device) - starts[token_req]
        return FlexMeta(batch.is_decode, slots, key_valid, seq_t,
                        torch.tensor(prefix, dtype=torch.int32, device=device), token_req,
                        token_pos, max(ext, default=0))

    def _meta(self, batch: ForwardBatch) -> FlexMeta:
        if not isinstance(batch.attn_meta, FlexMeta):
            batch.attn_meta = self.prepare(batch)
        return batch.attn_meta

    def _block_mask(self, meta: FlexMeta, window: int | None) -> BlockMask:
        if window not in meta.masks:
            seq, prefix = meta.seq_lens, meta.prefix_lens
            if window is None:
                def mask_mod(b, h, q_idx, kv_idx):
                    return (kv_idx < seq[b]) & (kv_idx <= prefix[b] + q_idx)
            else:
                w = torch.tensor(window, dtype=torch.int32, device=seq.device)

                def mask_mod(b, h, q_idx, kv_idx):
                    pos = prefix[b] + q_idx
                    return (kv_idx < seq[b]) & (kv_idx <= pos) & (kv_idx > pos - w)
            B, L = meta.slots.shape
            meta.masks[window] = create_block_mask(mask_mod, B, None, meta.q_len, L,
                                                   device=seq.device)
        return meta.masks[window]

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                layer: AttentionLayerParams, batch: ForwardBatch) -> torch.Tensor:
        T = q.shape[0]
        H, Hkv, D = layer.num_heads, layer.num_kv_heads, layer.head_dim
        Dv = layer.v_head_dim or D
        pool = batch.kv_pool
        pool.set_kv(layer.layer_id, batch.out_cache_loc, k.view(T, Hkv, D), v.view(T, Hkv, Dv))
        meta = self._meta(batch)
        k_buf, v_buf = pool.get_kv_buffer(layer.layer_id)
        B, L = meta.slots.shape
        keep = meta.key_valid[:, :, None, None]
        # [B, L, Hkv, D] -> [B, Hkv, L, D]; FP8 caches are dequantized here.
        kp = torch.where(keep, _dequant(k_buf[meta.slots], q.dtype, pool.k_scale), 0)
        vp = torch.where(keep, _dequant(v_buf[meta.slots], q.dtype, pool.v_scale), 0)
        qp = q.new_zeros(B, meta.q_len, H, D)
        qp[meta.token_req, meta.token_pos] = q.view(T, H, D)
        score_mod = None
        if layer.logit_softcap:
            # A tensor, not a float: torch.compile(dynamic=True) turns a captured float into an
            # input that inductor's flex lowering rejects ("unbacked_bindings").
            cap = torch.tensor(layer.logit_softcap, dtype=torch.float32, device=q.device)

            def score_mod(score, b, h, q_idx, kv_idx):
                return torch.tanh(score / cap) * cap
        out = self._flex(qp.transpose(1, 2), kp.transpose(1, 2), vp.transpose(1, 2),
                         score_mod=score_mod, block_mask=self._block_mask(meta,
                                                                          layer.sliding_window),
                         scale=layer.scaling, enable_gqa=H != Hkv)  # [B, H, Qmax, Dv]
        out = out.transpose(1, 2)[meta.token_req, meta.token_pos]  # [T, H, Dv]
        return out.reshape(T, H * Dv)


def _dequant(x: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    x = x.to(dtype)
    return x * scale if scale != 1.0 else x
