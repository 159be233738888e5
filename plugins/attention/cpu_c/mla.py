"""`cpu_c_mla*`: MLA (core.contract.mla) on the CPU with attn.c's decode kernel.

Decode runs absorbed over the latent pool in place: q_lat = q_nope @ w_kc per head, then one
kernel call attends [q_lat | q_rope] ([B, H, R + Dr]) over each request's latent rows as a single
KV head of width R + Dr whose values are the rows' first R entries (no gather, no per-head
expansion; every row is read once for all H heads), and o_lat @ w_vc^T gives [B, H, Dv]. Extend
(prefill, chunks, cached prefixes) is torch_native_mla's materialised form.
"""

from __future__ import annotations

import torch

from core.contract.attention import BackendContext
from core.contract.forward_batch import ForwardBatch
from core.contract.mla import MLALayerParams, MLAWeights
from plugins._kit.cbuild import prebuild
from plugins._kit.mla_torch import TorchMLA
from plugins.attention.cpu_c.backend import SOURCE, library


class CpuCMLA(TorchMLA):
    label = "cpu_c_mla attention"
    variant = "portable"

    @classmethod
    def prebuild(cls) -> None:
        """core.plan.prebuild's hook: attn.c compiled for this variant into the cache."""
        prebuild(SOURCE, cls.variant)

    def __init__(self, ctx: BackendContext):
        super().__init__(ctx)
        if torch.device(ctx.device).type != "cpu":
            raise ValueError(f"{self.label} runs on the CPU only, not on {ctx.device}")
        if ctx.kv_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"{self.label} reads float32 or bfloat16 latent caches, not "
                             f"{ctx.kv_dtype}")
        self.fn = library(self.variant).ca_mla_decode
        self.threads = torch.get_num_threads()

    def prepare(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Decode: each request's slots [B, max_seq] int64 and its length [B] int64, once for
        every layer of the step."""
        if not batch.is_decode:
            return None
        seq = list(batch.seq_lens_cpu)
        slots = batch.req_to_token[batch.req_pool_indices, :max(seq)].long().contiguous()
        return slots, torch.as_tensor(seq, dtype=torch.int64)

    def decode(self, q_nope: torch.Tensor, q_rope: torch.Tensor, buf: torch.Tensor,
               weights: MLAWeights, layer: MLALayerParams, batch: ForwardBatch
               ) -> torch.Tensor:
        if not isinstance(batch.attn_meta, tuple):
            batch.attn_meta = self.prepare(batch)
        slots, lens = batch.attn_meta
        B, H = q_nope.shape[:2]
        R, W = layer.kv_lora_rank, layer.latent_dim
        # the absorption runs in fp32 (CPUs without native bf16 GEMMs run torch's bf16 bmm
        # at a fraction of a GFLOP/s); the kernel reads q and writes o_lat in fp32
        f32 = torch.float32
        q_lat = torch.bmm(q_nope.to(f32).transpose(0, 1), weights.w_kc.to(f32))  # [H, B, R]
        q = torch.cat([q_lat.transpose(0, 1), q_rope.to(f32)], dim=-1).contiguous()  # [B,H,W]
        o_lat = torch.empty(B, H, R, dtype=f32)
        rc = self.fn(q.data_ptr(), buf.data_ptr(), int(buf.dtype == torch.bfloat16),
                     buf.stride(0), slots.data_ptr(), slots.stride(0), lens.data_ptr(), B, H, W,
                     R, layer.scaling, o_lat.data_ptr(), self.threads)
        if rc != 0:
            raise MemoryError(f"{self.label}: out of memory")
        # [H, B, R] @ [H, R, Dv] -> [B, H, Dv]
        return torch.bmm(o_lat.transpose(0, 1), weights.w_vc.to(f32).transpose(1, 2)
                         ).transpose(0, 1)


class CpuCMLAAvx512(CpuCMLA):
    variant = "avx512_vnni"


class CpuCMLAAvx2(CpuCMLA):
    variant = "avx2"
