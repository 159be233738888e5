"""Per-layer K/V buffers of the paged KV cache (storage only; allocation is memory_pool's job)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from core.contract.platform import Platform, platform_for_device


class KVPool:
    """K and V buffers for every layer, indexed by token slot.

    Slot s lives in page s // page_size. Slot 0 is reserved as a padding sink: it is never handed
    out, so padded writes (e.g. in captured graphs) land somewhere harmless.

    Shapes: k_buffers[layer], v_buffers[layer]: [num_slots, num_kv_heads, head_dim] (v: v_head_dim)

    FP8 caches (torch.float8_e4m3fn / float8_e5m2) hold values divided by a per-tensor scale:
    real K = stored K * k_scale (likewise V). The scales are 1.0 for every other dtype.

    `step` counts the forward steps run over the pool: whoever writes it (the model runner once
    per forward, a test or tool before a write of its own) calls `begin_step()` first. A backend
    that keeps a copy of some slots across steps (torch_native's dense decode cache) knows that
    nobody else wrote the pool when the step it sees is the one after its own.

    The buffers come from the Platform's `zeros` (the cpu target's cost nothing until touched);
    `platform` defaults to the one of `device`'s type (in-process use: tests, tools).
    """

    def __init__(self, num_slots: int, num_layers: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str, page_size: int = 1,
                 v_head_dim: int | None = None, k_scale: float = 1.0, v_scale: float = 1.0,
                 store: Callable | None = None, platform: Platform | None = None,
                 layers: Sequence[int] | None = None):
        """layers: the layer ids this pool holds buffers for (a hybrid pool's group,
        core.engine.memory.kv_groups); the others' entries are None. Default: all."""
        if num_slots < page_size * 2:
            raise ValueError(f"KV pool of {num_slots} slots is too small for page size "
                             f"{page_size}")
        self.num_slots = num_slots
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.v_head_dim = v_head_dim or head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        self.page_size = page_size
        if not (k_scale > 0 and v_scale > 0):
            raise ValueError(f"KV cache scales must be positive, got k_scale={k_scale}, "
                             f"v_scale={v_scale}")
        self.k_scale = float(k_scale)
        self.v_scale = float(v_scale)
        if platform is None:
            platform = platform_for_device(self.device)
        held = set(range(num_layers) if layers is None else layers)
        self.layers = tuple(sorted(held))
        self.k_buffers = [platform.zeros((num_slots, num_kv_heads, head_dim), dtype, self.device)
                          if i in held else None for i in range(num_layers)]
        self.v_buffers = [platform.zeros((num_slots, num_kv_heads, self.v_head_dim), dtype,
                                         self.device) if i in held else None
                          for i in range(num_layers)]
        self.step = 0
        # the layer ops' KV store (core.contract.layer_ops: one kernel for K and V where fused); returns
        # False for tensors it does not take, which the pool then writes itself
        self.store = store

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                        v_head_dim: int | None = None) -> int:
        elem = torch.tensor([], dtype=dtype).element_size()
        return num_layers * num_kv_heads * (head_dim + (v_head_dim or head_dim)) * elem

    def begin_step(self) -> int:
        """Start a forward step (or any write outside one); returns its number."""
        self.step += 1
        return self.step

    def get_kv_buffer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        kb = self.k_buffers[layer_id]
        if kb is None:
            self._not_here(layer_id)
        return kb, self.v_buffers[layer_id]

    def _not_here(self, layer_id: int) -> None:
        raise RuntimeError(
            f"layer {layer_id}'s K/V are in another group of the hybrid KV pool (this one holds "
            f"layers {list(self.layers)}): the model must run each layer's attention on "
            f"batch.for_layer(layer_id) (or serve with --disable-hybrid-kv)")

    def set_kv(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write new tokens' K/V. loc: [T] slots; k: [T, kv_heads, head_dim]; v likewise."""
        kb, vb = self.k_buffers[layer_id], self.v_buffers[layer_id]
        if kb is None:
            self._not_here(layer_id)
        if self.k_scale != 1.0:
            k = k / self.k_scale
        if self.v_scale != 1.0:
            v = v / self.v_scale
        if self.store is not None and self.store(k, v, loc, kb, vb):
            return
        kb[loc] = k.to(self.dtype)
        vb[loc] = v.to(self.dtype)


class MLAKVPool:
    """The MLA latent cache (core.contract.mla): one row of kv_lora_rank + qk_rope_head_dim
    values per token and layer, [latent | k_rope], shared by every head.

    Slots, pages, the padding sink slot 0 and `step` as in KVPool. Shapes:
    latent_buffers[layer]: [num_slots, latent_dim]. No FP8 scale yet (k_scale = v_scale = 1).
    """

    k_scale = 1.0
    v_scale = 1.0

    def __init__(self, num_slots: int, num_layers: int, kv_lora_rank: int, qk_rope_head_dim: int,
                 dtype: torch.dtype, device: torch.device | str, page_size: int = 1,
                 platform: Platform | None = None):
        if num_slots < page_size * 2:
            raise ValueError(f"KV pool of {num_slots} slots is too small for page size "
                             f"{page_size}")
        self.num_slots = num_slots
        self.num_layers = num_layers
        self.kv_lora_rank = kv_lora_rank
        self.qk_rope_head_dim = qk_rope_head_dim
        self.latent_dim = kv_lora_rank + qk_rope_head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        self.page_size = page_size
        if platform is None:
            platform = platform_for_device(self.device)
        self.latent_buffers = [platform.zeros((num_slots, self.latent_dim), dtype, self.device)
                               for _ in range(num_layers)]
        self.step = 0

    @staticmethod
    def bytes_per_token(num_layers: int, kv_lora_rank: int, qk_rope_head_dim: int,
                        dtype: torch.dtype) -> int:
        elem = torch.tensor([], dtype=dtype).element_size()
        return num_layers * (kv_lora_rank + qk_rope_head_dim) * elem

    def begin_step(self) -> int:
        """Start a forward step (or any write outside one); returns its number."""
        self.step += 1
        return self.step

    def get_latent_buffer(self, layer_id: int) -> torch.Tensor:
        return self.latent_buffers[layer_id]

    def set_latent(self, layer_id: int, loc: torch.Tensor, latent: torch.Tensor,
                   k_rope: torch.Tensor) -> None:
        """Write new tokens' rows. loc: [T] slots; latent [T, kv_lora_rank]; k_rope [T, Dr]."""
        buf = self.latent_buffers[layer_id]
        buf[loc, :self.kv_lora_rank] = latent.to(self.dtype)
        buf[loc, self.kv_lora_rank:] = k_rope.to(self.dtype)


def checkpoint_kv_scales(model: object, kv_dtype: torch.dtype, notes: list[str]
                         ) -> tuple[float, float]:
    """An FP8 pool's (k_scale, v_scale): the checkpoint's calibrated per-layer scales where the
    loader found them (`model.kv_cache_scales`), else 1.0. The pool keeps one scale per tensor
    kind, so the largest layer's is used (no layer overflows; layers calibrated smaller keep
    less precision); `notes` gets a line saying which."""
    scales = getattr(model, "kv_cache_scales", None) or {}
    if not scales or kv_dtype.itemsize != 1:
        if scales:
            notes.append("the checkpoint's KV-cache scales are unused: the KV cache is not FP8 "
                         "(--kv-cache-dtype fp8_e4m3 uses them)")
        return 1.0, 1.0
    k = max(v.get("k", 1.0) for v in scales.values())
    v = max(v.get("v", 1.0) for v in scales.values())
    notes.append(f"FP8 KV cache scales from the checkpoint ({len(scales)} layers): "
                 f"k_scale {k:.4g}, v_scale {v:.4g} (the largest layer's; one per pool)")
    return k, v
