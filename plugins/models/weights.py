"""Checkpoint-name -> parameter mapping shared by the model classes, with strict accounting."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable

import torch
from torch import nn

from core.layers.linear import process_weights_after_loading

# Tensors some checkpoints carry that hold no weights.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")
# Calibrated FP8 KV-cache scales, per layer, under the names FP8 checkpoints use
# (`self_attn.k_scale`; compressed-tensors' older `self_attn.k_proj.output_scale`).
_KV_SCALE = re.compile(r"(?:.*\.)?layers\.(\d+)\.self_attn\.(?:(k|v)_scale|(k|v)_proj\.output_scale)")


def kv_scale_of(hf_name: str) -> tuple[int, str] | None:
    """(layer, "k" | "v") for a checkpoint's KV-cache scale tensor, None for other names."""
    m = _KV_SCALE.fullmatch(hf_name)
    if m is None:
        return None
    return int(m.group(1)), m.group(2) or m.group(3)


def _listing(names: list[str], limit: int = 12) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f", ... ({len(names) - limit} more)" if len(names) > limit else "")


def load_named_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]],
                       stacked: tuple[tuple[str, str, str], ...] = (),
                       skip_lm_head: bool = False,
                       rename: Callable[[str], tuple[str, str | None] | None] | None = None
                       ) -> None:
    """Copy HF-named tensors into `model`; every parameter (and every stacked shard) must be set.

    stacked: (hf_name, our_name, shard): `...q_proj.weight` goes to shard "q" of
    `...qkv_proj.weight` through the owning layer's `weight_loader`.
    rename: hf_name -> (our parameter name, shard), or None to use the table: for names a
    table cannot express (per-expert tensors, shard "3.gate"). An owner with `param_shards(leaf)`
    lists the shards it expects per parameter; one tensor loaded with no shard fills them all.
    Raises ValueError naming the missing, unexpected and wrong-shape tensors together.
    Calibrated KV-cache scales (`layers.N.self_attn.k_scale` / `v_scale`) are collected into
    `model.kv_cache_scales` ({layer: {"k": float, "v": float}}) for the KV pool.
    """
    params = dict(model.named_parameters())
    owners = {}
    for mod_name, module in model.named_modules():
        for p_name, _ in module.named_parameters(recurse=False):
            full = f"{mod_name}.{p_name}" if mod_name else p_name
            if full in params:
                owners[full] = module
    expected: set[tuple[str, str | None]] = set()
    def shards_of(name: str) -> list[str] | None:
        owner, leaf = owners.get(name), name.rsplit(".", 1)[-1]
        if hasattr(owner, "param_shards"):
            return owner.param_shards(leaf)
        shards = getattr(owner, "shard_names", None)
        return shards if leaf in ("weight", "bias") else None

    for name in params:
        shards = shards_of(name)
        if shards:
            expected.update((name, s) for s in shards)
        else:
            expected.add((name, None))

    loaded: set[tuple[str, str | None]] = set()
    unexpected: list[str] = []
    bad_shape: list[str] = []
    kv_scales: dict[int, dict[str, float]] = {}
    for hf_name, tensor in weights:
        if hf_name.endswith(_IGNORED_SUFFIXES):
            continue
        kv = kv_scale_of(hf_name)
        if kv is not None:  # read, not loaded: the KV pool is built after the model
            kv_scales.setdefault(kv[0], {})[kv[1]] = float(tensor.float().max())
            continue
        if skip_lm_head and hf_name.startswith("lm_head."):
            continue  # tied to the embedding
        target, shard = hf_name, None
        renamed = rename(hf_name) if rename is not None else None
        if renamed is not None:
            target, shard = renamed
        else:
            for hf_part, our_part, shard_name in stacked:
                if f".{hf_part}." in hf_name:
                    target, shard = hf_name.replace(f".{hf_part}.", f".{our_part}."), shard_name
                    break
        if target not in params:
            if hf_name.endswith(".bias") and not tensor.any():
                continue  # zero biases of bias-free layers (older AutoGPTQ exports): a no-op
            unexpected.append(hf_name)
            continue
        param, owner = params[target], owners[target]
        try:
            with torch.no_grad():
                if hasattr(owner, "weight_loader"):
                    owner.weight_loader(param, tensor, shard)
                else:
                    if tuple(param.shape) != tuple(tensor.shape):
                        raise ValueError(f"expected shape {tuple(param.shape)}, got "
                                         f"{tuple(tensor.shape)}")
                    param.data.copy_(tensor)
        except ValueError as exc:
            bad_shape.append(f"{hf_name} ({exc})")
            continue
        loaded.add((target, shard))
        if shard is None and hasattr(owner, "param_shards"):
            loaded.update((target, s) for s in owner.param_shards(target.rsplit(".", 1)[-1])
                          or ())

    missing = sorted(f"{n}" if s is None else f"{n}[{s}]" for n, s in expected - loaded)
    # Report stacked shards under their HF names, which is what the user's checkpoint lacks.
    for hf_part, our_part, shard_name in stacked:
        missing = [m.replace(f".{our_part}.", f".{hf_part}.").replace(f"[{shard_name}]", "")
                   if m.endswith(f"[{shard_name}]") and f".{our_part}." in m else m
                   for m in missing]
    problems = []
    if missing:
        problems.append(f"missing tensors: {_listing(missing)}")
    if unexpected:
        problems.append(f"unexpected tensors: {_listing(unexpected)}")
    if bad_shape:
        problems.append(f"wrong-shape tensors: {_listing(bad_shape)}")
    if problems:
        raise ValueError(f"checkpoint does not match {type(model).__name__}: "
                         + "; ".join(problems))
    model.kv_cache_scales = kv_scales  # {layer: {"k": s, "v": s}}; {} when the file has none
    process_weights_after_loading(model)
