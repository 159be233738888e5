"""The mxfp4 method: dense linears (core's DenseLinearMethod, unchanged), MXFP4 MoE experts.

Experts are created under the checkpoint's tensor shapes (HF GPT-OSS, per MoE layer), with our
names and our row order (gate rows, then up rows: core.contract.moe.W13_LAYOUT):

  w13_blocks uint8 [E, 2I, H/32, 16]   <- mlp.experts.gate_up_proj_blocks
  w13_scales uint8 [E, 2I, H/32]       <- mlp.experts.gate_up_proj_scales
  w13_bias   fp32  [E, 2I]             <- mlp.experts.gate_up_proj_bias
  w2_blocks  uint8 [E, H, I/32, 16]    <- mlp.experts.down_proj_blocks
  w2_scales  uint8 [E, H, I/32]        <- mlp.experts.down_proj_scales
  w2_bias    fp32  [E, H]              <- mlp.experts.down_proj_bias

GPT-OSS interleaves the gate and up rows of its gate_up tensors (row 2i gate i, row 2i + 1 up
i); the model puts them in our order before loading: plugins._kit.mxfp4.gpt_oss_expert_tensor
maps each HF tensor to its parameter here, gate_up rows reordered. Every tensor may come whole (the MoE layer's
weight_loader, shard None) or per expert and projection (shards "3.gate" / "3.up" / "3.down").

After loading the experts are form "mxfp4" (core.contract.moe.MoEWeights): w13 uint8
[E, 2I, H/2], w2 uint8 [E, H, I/2] (plugins/_kit/mxfp4's packed layout: the blocks' bytes,
reshaped, not copied) with extra "w13_scale" / "w2_scale" (uint8 [E, N, K/32]) and
"w13_bias" / "w2_bias" (fp32 [E, N]): the runner adds each bias to its product (before the
activation for w13, before the routing weight for w2).
"""

from __future__ import annotations

import torch
from torch import nn

from core.contract.quant import QuantScheme
from core.layers.linear import DenseLinearMethod
from plugins._kit.mxfp4 import BLOCK, E8M0_NAN, check_shape, from_hf_blocks
from plugins._kit.quant_common import parameter, replace_param

# --load-format dummy: scales of 2^-7, so the e2m1 values (|v| <= 6, about 2.4 on average)
# give weights of about 0.02, the loader's std for dense ones
_DUMMY_SCALE = 127 - 7


class Mxfp4Method(DenseLinearMethod):
    """Linears: the dense method as it is (the checkpoint holds them dense). MoE experts:
    MXFP4, kept packed."""

    def __init__(self, scheme: QuantScheme):
        if scheme.format != "mxfp4":
            raise ValueError(f"mxfp4 cannot compute {scheme.format} weights")
        dense_experts = [str(m) for m in scheme.raw.get("modules_to_not_convert") or ()
                         if "experts" in str(m)]
        if dense_experts:
            raise ValueError("mxfp4: modules_to_not_convert leaves some MoE experts dense "
                             f"({', '.join(dense_experts)}); one model's experts are all "
                             "MXFP4 here")
        super().__init__(scheme)
        self._layers = 0
        self._bytes = 0
        self._nan_scales = 0

    # ---- MoE experts ----

    def create_moe_weights(self, layer: nn.Module, num_experts: int, hidden_size: int,
                           intermediate_size: int, dtype: torch.dtype,
                           device: torch.device) -> None:
        check_shape(hidden_size, f"the hidden size ({hidden_size}, w13's inputs)")
        check_shape(intermediate_size, f"the intermediate size ({intermediate_size}, w2's "
                                       "inputs)")
        gen = torch.Generator(device=device).manual_seed(num_experts * 7919 + hidden_size)
        for name, (n, k) in (("w13", (2 * intermediate_size, hidden_size)),
                             ("w2", (hidden_size, intermediate_size))):
            # Filled as --load-format dummy wants them (loading replaces every byte): random
            # codes, scales of _DUMMY_SCALE.
            blocks = parameter((num_experts, n, k // BLOCK, BLOCK // 2), torch.uint8, device)
            blocks.data.copy_(torch.randint(0, 256, blocks.shape, dtype=torch.uint8,
                                            device=device, generator=gen))
            setattr(layer, f"{name}_blocks", blocks)
            setattr(layer, f"{name}_scales", parameter((num_experts, n, k // BLOCK),
                                                       torch.uint8, device, _DUMMY_SCALE))
            setattr(layer, f"{name}_bias", parameter((num_experts, n), torch.float32, device,
                                                     0.0))

    def process_moe_weights_after_loading(self, layer: nn.Module) -> None:
        """The blocks reshaped into packed rows (no copy) under w13_weight / w2_weight, the
        scales under w13_scale / w2_scale; the checkpoint-shaped names dropped."""
        for name in ("w13", "w2"):
            packed, scales = from_hf_blocks(getattr(layer, f"{name}_blocks").data,
                                            getattr(layer, f"{name}_scales").data, name)
            replace_param(layer, f"{name}_blocks", None)
            replace_param(layer, f"{name}_scales", None)
            replace_param(layer, f"{name}_weight", packed.contiguous())
            replace_param(layer, f"{name}_scale", scales.contiguous())
            self._bytes += packed.numel() + scales.numel()
            self._nan_scales += int((scales == E8M0_NAN).sum())
        self._layers += 1

    def moe_weights(self, layer: nn.Module):
        from core.contract.moe import MoEWeights

        return MoEWeights(layer.w13_weight, layer.w2_weight, form="mxfp4",
                          extra={"w13_scale": layer.w13_scale, "w2_scale": layer.w2_scale,
                                 "w13_bias": layer.w13_bias, "w2_bias": layer.w2_bias})

    def load_summary(self) -> str | None:
        if not self._layers:
            return None
        note = (f"mxfp4: {self._layers} MoE layers' experts kept packed "
                f"({self._bytes / 2 ** 30:.2f} GiB with their scales); other layers dense")
        if self._nan_scales:
            note += (f"; {self._nan_scales} scale bytes are 0xFF, which MX defines as NaN: "
                     "those blocks compute NaN")
        return note
