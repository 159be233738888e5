"""The MLA attention layer (core.contract.mla): holds kv_b_proj's weight and the layer's static
parameters, and delegates to the step's MLA backend."""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from core.contract.forward_batch import ForwardBatch
from core.contract.mla import MLAAttentionBackend, MLALayerParams, MLAWeights
from core.layers.linear import DenseLinearMethod, Linear


class MLAAttention(nn.Module):
    """Multi-head latent attention over the latent cache.

    `kv_b_proj` (the checkpoint's name under this module) is built as a column-parallel
    `Linear` of the model's quant method, so that it loads whatever the checkpoint holds (a
    dense weight, or e.g. e4m3 codes with their `weight_scale_inv`) and, under tensor
    parallelism, only this rank's heads' rows (per head, Dn rows of k_nope then Dv of v: an
    even split of the rows is a split by heads). Once loaded (`finish_loading`) it becomes a
    plain module holding `weight` [H * (Dn + Dv), R] dense in the compute dtype, in the
    checkpoint's layout (QuantMethod.dense_weight dequantizes a quantized one, exactly, in
    fp32, then it is cast once): the backend uses its two halves (MLAWeights) to expand the
    latent or to absorb it, so no quant method or platform repacks it. A dense checkpoint
    quantized at load (--quantization) keeps kv_b_proj dense: nothing to dequantize.
    `params.num_heads` is this rank's head count.
    """

    def __init__(self, params: MLALayerParams, dtype: torch.dtype,
                 device: torch.device | None = None, ctx=None):
        super().__init__()
        self.params = params
        self.dtype = dtype
        rows = params.num_heads * (params.qk_nope_head_dim + params.v_head_dim)
        if ctx is None:  # one rank, a dense weight
            self.kv_b_proj = _dense_holder(torch.empty(rows, params.kv_lora_rank, dtype=dtype,
                                                       device=device))
        else:  # the model's sizes: the Linear cuts this rank's rows (tp.size * rows of them)
            if getattr(getattr(ctx.quant_method, "scheme", None), "online", False):
                # quantizing at load: the checkpoint's kv_b_proj is dense and stays so
                ctx = replace(ctx, quant_method=DenseLinearMethod())
            self.kv_b_proj = Linear(params.kv_lora_rank, rows * ctx.tp.size, False, ctx,
                                    parallel="column" if ctx.tp.active else None)
        self.dequantized = False  # whether finish_loading dequantized a quantized weight
        self._weights: MLAWeights | None = None

    def finish_loading(self) -> None:
        """After the linears' process_weights_after_loading: kv_b_proj's weight dense in the
        compute dtype, the Linear replaced by a plain holder (idempotent)."""
        layer = self.kv_b_proj
        if not isinstance(layer, Linear):
            return
        method = layer.quant_method
        if isinstance(method, DenseLinearMethod):
            weight = layer.weight.data
        else:
            dense = method.dense_weight(layer)
            if dense is None:
                raise ValueError(f"kv_b_proj of MLA layer {self.params.layer_id}: quant method "
                                 f"{type(method).__name__} cannot give its weight back dense "
                                 "(QuantCaps.dense_weights), which MLA absorption needs")
            weight = dense.to(self.dtype)
            self.dequantized = True
        self.kv_b_proj = _dense_holder(weight.contiguous())
        self._weights = None

    def reset_bindings(self) -> None:
        self._weights = None  # the weight may have been replaced (loading)

    def weights(self) -> MLAWeights:
        if self._weights is None:
            if isinstance(self.kv_b_proj, Linear):
                raise RuntimeError("MLA weights used before loading finished")
            self._weights = MLAWeights.split(self.kv_b_proj.weight, self.params.num_heads,
                                             self.params.qk_nope_head_dim)
        return self._weights

    def forward(self, q_nope: torch.Tensor, q_rope: torch.Tensor, latent: torch.Tensor,
                k_rope: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """q_nope [T, H, Dn], q_rope [T, H, Dr] (rotated), latent [T, R] (normed), k_rope
        [T, Dr] (rotated) -> [T, H * Dv]; the backend writes the latent rows into the pool."""
        backend = batch.attn_backend
        if not isinstance(backend, MLAAttentionBackend):
            raise TypeError(f"an MLA model needs an MLA attention backend, not "
                            f"{type(backend).__name__}")
        return backend.forward_mla(q_nope, q_rope, latent, k_rope, self.weights(), self.params,
                                   batch)


def _dense_holder(weight: torch.Tensor) -> nn.Module:
    holder = nn.Module()
    holder.weight = nn.Parameter(weight, requires_grad=False)
    return holder
