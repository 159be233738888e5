"""Attention over the paged KV cache in plain PyTorch: the `torch_native` backend's class, and
the base of the CPU decode backends (pool_attention.py: cpu_c, numba_cpu).

Per step, `prepare` turns the request-to-token table into one padded slot matrix shared by all
layers (host-side lengths come from the batch's *_cpu lists, so nothing syncs with the device).
Per layer, `forward` writes the new K/V at `out_cache_loc`, gathers each request's K/V by slot and
runs attention:
- decode: one batched SDPA over the padded [B, L] keys with a padding / window mask;
- extend: a loop over requests, each query block [prefix, seq) against all its keys [0, seq)
  (on a CPU a long prompt without prefix goes in causal query blocks: _causal_in_blocks).
Soft-capped layers use an explicit fp32-softmax path, since SDPA cannot cap the logits.
On a CPU, decode reads K/V from a dense copy carried across steps (dense_decode.py) instead of
gathering the padded batch out of the pool at every layer of every step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from core.contract.attention import AttentionBackend, AttentionLayerParams, BackendContext
from core.contract.forward_batch import ForwardBatch
from plugins._kit.dense_decode import DenseDecodeCache


@dataclass
class TorchNativeMeta:
    """Per-step metadata, computed once and shared by every layer of the step."""

    decode: bool
    slots: torch.Tensor  # [B, max_seq] int64 slot of each request's token j (0-padded)
    seq_lens: list[int]
    prefix_lens: list[int]
    extend_lens: list[int]
    starts: list[int]  # offset of each request's first new token in q / k / v
    masks: dict = field(default_factory=dict)  # (kind, ...) -> bool mask, built lazily
    dense_step: int = 0  # decode: the pool's step (KVPool.step), 0 when the dense cache does not serve it
    dense_continued: bool = False  # decode: the dense cache may append to its last step


# Query rows per block of a long causal prefill on a CPU (see _causal_in_blocks).
CAUSAL_BLOCK = 128


class TorchNativeAttention(AttentionBackend):
    """Pure-PyTorch paged attention: MHA/GQA/MQA, sliding window, logit soft-cap, any page."""

    def __init__(self, ctx: BackendContext):
        super().__init__(ctx)
        # CPU only: elsewhere the gather is cheap next to the bandwidth, and checking that the
        # copy is still valid would read device tensors on the host.
        self._cpu = torch.device(ctx.device).type == "cpu"
        self._dense = DenseDecodeCache() if self._cpu else None

    def prepare(self, batch: ForwardBatch) -> TorchNativeMeta:
        seq = list(batch.seq_lens_cpu)
        if batch.is_decode:
            prefix = [s - 1 for s in seq]
            ext = [1] * len(seq)
        else:
            prefix = list(batch.prefix_lens_cpu)
            ext = list(batch.extend_lens_cpu)
        starts, t = [], 0
        for n in ext:
            starts.append(t)
            t += n
        max_len = max(seq) if seq else 0
        # [B, max_len]: one row gather from the table, done once per step.
        slots = batch.req_to_token[batch.req_pool_indices, :max_len].long()
        meta = TorchNativeMeta(batch.is_decode, slots, seq, prefix, ext, starts)
        if (batch.is_decode and self._dense is not None and seq
                and getattr(batch.kv_pool, "step", None) is not None):
            step, usable, continued = self._dense.begin_step(
                batch.kv_pool, batch.req_pool_indices, slots, seq)
            meta.dense_step, meta.dense_continued = (step if usable else 0), continued
        return meta

    def _meta(self, batch: ForwardBatch) -> TorchNativeMeta:
        if not isinstance(batch.attn_meta, TorchNativeMeta):
            batch.attn_meta = self.prepare(batch)
        return batch.attn_meta

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                layer: AttentionLayerParams, batch: ForwardBatch) -> torch.Tensor:
        T = q.shape[0]
        H, Hkv, D = layer.num_heads, layer.num_kv_heads, layer.head_dim
        Dv = layer.v_head_dim or D
        pool = batch.kv_pool
        meta = self._meta(batch)
        k, v = k.view(T, Hkv, D), v.view(T, Hkv, Dv)
        pool.set_kv(layer.layer_id, batch.out_cache_loc, k, v)
        k_buf, v_buf = pool.get_kv_buffer(layer.layer_id)
        if meta.decode:
            dense = None
            if meta.dense_step:  # [B, Hkv, L, D] each, from the copy carried across steps
                loc = batch.out_cache_loc  # the new tokens read back as the pool holds them
                dense = self._dense.layer_kv(
                    layer.layer_id, k_buf, v_buf, k_buf.index_select(0, loc),
                    v_buf.index_select(0, loc), meta.dense_step, meta.dense_continued,
                    q.dtype)
            out = self._decode(q.view(T, H, D), k_buf, v_buf, layer, meta, dense)
        else:
            out = self._extend(q.view(T, H, D), k_buf, v_buf, layer, meta)
        return out.reshape(T, H * Dv)

    # decode: every request has one query at position seq_len - 1
    def _decode(self, q, k_buf, v_buf, layer, meta, dense=None):
        B = len(meta.seq_lens)
        Hkv = layer.num_kv_heads
        # The G = H / Hkv query heads sharing a KV head become G queries of that head
        # ([B, Hkv, G, D]): K/V are read once per KV head, and SDPA needs no GQA expansion
        # (CPU bf16: 5x faster than one query per head with enable_gqa).
        qg = q.view(B, Hkv, -1, q.shape[-1])
        if B == 1:
            # Batch of one (latency path): no padding, the window is a slice.
            n = meta.seq_lens[0]
            lo = max(0, n - layer.sliding_window) if layer.sliding_window else 0
            if dense is not None:
                k, v = dense[0][:, :, lo:n], dense[1][:, :, lo:n]
            else:
                idx = meta.slots[0, lo:n]
                k = _gather(k_buf, idx, q.dtype).transpose(0, 1).unsqueeze(0)  # [1, Hkv, L, D]
                v = _gather(v_buf, idx, q.dtype).transpose(0, 1).unsqueeze(0)
            out = _attend(qg, k, v, None, False, layer, grouped=True)  # [1, Hkv, G, Dv]
            return out.reshape(1, -1, out.shape[-1])
        if dense is not None:
            k, v = dense
        else:
            k = _gather(k_buf, meta.slots, q.dtype).transpose(1, 2)  # [B, Hkv, L, D]
            v = _gather(v_buf, meta.slots, q.dtype).transpose(1, 2)
        # [B, 1, 1, L]; additive (0 / -inf in q's dtype) for SDPA, whose CPU kernel runs 10-15%
        # faster with it than with a bool mask; the soft-cap / sinks path fills by a bool mask
        mask = self._decode_mask(meta, layer.sliding_window, q.device,
                                 None if layer.logit_softcap or layer.sinks is not None
                                 else q.dtype)
        out = _attend(qg, k, v, mask, False, layer, grouped=True)  # [B, Hkv, G, Dv]
        return out.reshape(B, -1, out.shape[-1])

    def _decode_mask(self, meta, window, device, additive=None):
        if additive is not None:
            key = ("decode", window, additive)
            if key not in meta.masks:
                visible = self._decode_mask(meta, window, device)
                meta.masks[key] = torch.zeros(visible.shape, dtype=additive, device=device
                                              ).masked_fill_(~visible, float("-inf"))
            return meta.masks[key]
        key = ("decode", window)
        if key not in meta.masks:
            L = meta.slots.shape[1]
            j = torch.arange(L, device=device)
            seq = torch.tensor(meta.seq_lens, device=device).unsqueeze(1)
            visible = j < seq  # [B, L]
            if window:
                visible &= j >= seq - window
            meta.masks[key] = visible.view(len(meta.seq_lens), 1, 1, L)
        return meta.masks[key]

    # extend: request i's new queries sit at positions prefix_i .. seq_i - 1
    def _extend(self, q, k_buf, v_buf, layer, meta):
        outs = []
        window = layer.sliding_window
        for i, (n, start) in enumerate(zip(meta.extend_lens, meta.starts, strict=True)):
            if n == 0:
                continue
            L, P = meta.seq_lens[i], meta.prefix_lens[i]
            # Keys older than the first query's window are never visible: skip gathering them.
            lo = max(0, P - window + 1) if window else 0
            idx = meta.slots[i, lo:L]
            k = _gather(k_buf, idx, q.dtype).transpose(0, 1).unsqueeze(0)  # [1, Hkv, L-lo, D]
            v = _gather(v_buf, idx, q.dtype).transpose(0, 1).unsqueeze(0)
            qi = q[start:start + n].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
            if lo == 0 and P == 0 and (window is None or window >= L):
                if self._cpu and n >= 2 * CAUSAL_BLOCK:
                    out = self._causal_in_blocks(qi, k, v, layer, meta)
                else:
                    out = _attend(qi, k, v, None, True, layer)
            else:
                out = _attend(qi, k, v, self._extend_mask(meta, i, lo, window, q.device),
                              False, layer)
            outs.append(out[0].transpose(0, 1))  # [n, H, Dv]
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def _causal_in_blocks(self, q, k, v, layer, meta, block: int = CAUSAL_BLOCK):
        """Causal attention of n queries over their own n keys, one block of queries at a time:
        block [s, e) attends keys [0, e) with the causal mask, so no block computes scores past
        its own last query (torch's CPU kernel given is_causal over the whole square took 150 ms
        of attention per bf16 512-token forward of SmolLM2 here, blocks 104 ms). The block
        masks are built once per step and shared by the layers (meta.masks)."""
        n = q.shape[2]
        outs = [_attend(q[:, :, :block], k[:, :, :block], v[:, :, :block], None, True, layer)]
        for s in range(block, n, block):
            e = min(s + block, n)
            key = ("causal_block", s, e)
            if key not in meta.masks:
                meta.masks[key] = torch.ones(e - s, e, dtype=torch.bool,
                                             device=q.device).tril(s)
            outs.append(_attend(q[:, :, s:e], k[:, :, :e], v[:, :, :e], meta.masks[key], False,
                                layer))
        return torch.cat(outs, dim=2)

    def _extend_mask(self, meta, i, lo, window, device):
        key = ("extend", window, i)
        if key not in meta.masks:
            P, L = meta.prefix_lens[i], meta.seq_lens[i]
            pos = torch.arange(P, L, device=device).unsqueeze(1)  # [n, 1] query positions
            j = torch.arange(lo, L, device=device).unsqueeze(0)  # [1, L-lo] key positions
            visible = j <= pos
            if window:
                visible &= j > pos - window
            meta.masks[key] = visible
        return meta.masks[key]


def _gather(buf: torch.Tensor, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """buf[slots] ([..., heads, dim]) in the compute dtype; index_select is the cheaper gather."""
    out = buf.index_select(0, slots.reshape(-1)).view(*slots.shape, *buf.shape[1:])
    return out if out.dtype == dtype else out.to(dtype)


def _attend(q, k, v, mask, causal, layer: AttentionLayerParams, grouped: bool = False):
    """q [B, H, n, D], k/v [B, Hkv, L, D] (a bool mask broadcastable to [B, H, n, L]).

    grouped: q is [B, Hkv, n, D] already, each KV head's query heads folded into n (decode)."""
    gqa = not grouped and layer.num_heads != layer.num_kv_heads
    if layer.logit_softcap or layer.sinks is not None:
        return _explicit_attention(q, k, v, mask, causal, layer, gqa)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                          scale=layer.scaling, enable_gqa=gqa)


def _explicit_attention(q, k, v, mask, causal, layer, gqa):
    """Scores, soft-cap and sinks written out (SDPA has neither). A bool mask only.

    Sinks: q's head axis is [H] (ungrouped) or [Hkv, G] folded as KV head x its G query heads
    (grouped decode); either way its index order is the query heads' order, so the sinks
    reshape onto it."""
    group = layer.num_heads // layer.num_kv_heads if gqa else 1
    if group > 1:
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
    s = torch.matmul(q, k.transpose(-1, -2)).float() * layer.scaling  # [B, H, n, L]
    cap = layer.logit_softcap
    if cap:
        s = torch.tanh(s / cap) * cap
    if causal:
        n, L = s.shape[-2:]
        mask = torch.ones(n, L, dtype=torch.bool, device=s.device).tril(L - n)
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    if layer.sinks is None:
        p = torch.softmax(s, dim=-1)
    else:  # one more score per row, whose value is zero: dropped after the softmax
        B, A, n, L = s.shape
        sink = layer.sinks.float().to(s.device).view(1, A, -1, 1).expand(B, A, n, 1)
        p = torch.softmax(torch.cat([s, sink], dim=-1), dim=-1)[..., :L]
    return torch.matmul(p.to(v.dtype), v)
