"""Rotary position embedding (NeoX / HF half-rotation layout), cos/sin computed in fp32.

Supported `rope_type`s: default, linear, llama3, yarn (DeepSeek's: its attention factor scales
cos/sin; the softmax-scale part, mscale_all_dim, is the model's: `yarn_softmax_mscale`). Parameters are read from an HF config in either
transformers 5 form (`rope_parameters`) or the older one (`rope_theta` + `rope_scaling`).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from core.contract.json_types import JSONObject


def rope_parameters(config: object) -> JSONObject:
    """The config's RoPE parameters as one dict with at least rope_type and rope_theta."""
    params = getattr(config, "rope_parameters", None)
    if params and "rope_theta" not in params and all(isinstance(v, dict) for v in params.values()):
        raise ValueError("per-layer-type rope parameters are not supported")
    if not params:
        params = dict(getattr(config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    params = dict(params)
    params["rope_type"] = params.get("rope_type") or params.get("type") or "default"
    return params


def inv_frequencies(head_dim: int, params: JSONObject, max_position: int) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] in fp32 for the given rope parameters."""
    if float(params.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError("partial_rotary_factor != 1 is not supported")
    base = float(params["rope_theta"])
    pos_freqs = base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
    inv = 1.0 / pos_freqs
    kind = params["rope_type"]
    if kind == "default":
        return inv
    if kind == "linear":
        return inv / float(params["factor"])
    if kind == "llama3":
        factor = float(params["factor"])
        low, high = float(params["low_freq_factor"]), float(params["high_freq_factor"])
        old_len = float(params.get("original_max_position_embeddings", max_position))
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv
        # long wavelengths are slowed down by `factor`, short ones kept, the middle interpolated
        scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    if kind == "yarn":
        return _yarn_inv_frequencies(pos_freqs, head_dim, base, params, max_position)
    raise ValueError(f"rope_type {kind!r} is not supported (supported: default, linear, llama3, "
                     f"yarn)")


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction 0.1 * mscale * ln(scale) + 1 (1 for scale <= 1)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_factor(params: JSONObject, max_position: int) -> float:
    factor = params.get("factor")
    if factor is None:  # DeepSeek-V3 may leave it to the two lengths
        return max_position / float(params["original_max_position_embeddings"])
    return float(factor)


def _yarn_inv_frequencies(pos_freqs: torch.Tensor, head_dim: int, base: float,
                          params: JSONObject, max_position: int) -> torch.Tensor:
    """YaRN: low frequencies interpolated by `factor`, high ones kept, a linear ramp between
    the dims that turn beta_slow and beta_fast times over the original context. `truncate`
    (default true; GPT-OSS's configs say false) rounds the ramp's ends to whole dims. Computed
    as transformers' _compute_yarn_parameters does, operation for operation (1 / (factor *
    base^(2i/d)) for the interpolated frequencies), so the tables agree bit for bit."""
    factor = _yarn_factor(params, max_position)
    old_len = float(params["original_max_position_embeddings"])
    beta_fast = float(params.get("beta_fast") or 32)
    beta_slow = float(params.get("beta_slow") or 1)

    def dim_of(rotations: float) -> float:  # the dim that turns `rotations` times over old_len
        return head_dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim_of(beta_fast), dim_of(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (the original frequency), 0: interpolate
    return 1.0 / (factor * pos_freqs) * (1 - keep) + 1.0 / pos_freqs * keep


def attention_factor(params: JSONObject, max_position: int) -> float:
    """What cos/sin are multiplied by: YaRN's attention factor (given, or mscale / mscale_all_dim
    ratio, or its default mscale); 1 for the other rope types."""
    if params["rope_type"] != "yarn":
        return 1.0
    if params.get("attention_factor") is not None:
        return float(params["attention_factor"])
    factor = _yarn_factor(params, max_position)
    mscale, mscale_all = params.get("mscale"), params.get("mscale_all_dim")
    if mscale and mscale_all:
        return yarn_mscale(factor, float(mscale)) / yarn_mscale(factor, float(mscale_all))
    return yarn_mscale(factor)


def yarn_softmax_mscale(params: JSONObject, max_position: int) -> float:
    """The factor MLA models (DeepSeek) fold into the softmax scale: mscale(factor,
    mscale_all_dim) ** 2 under YaRN with mscale_all_dim set, else 1."""
    if params["rope_type"] == "default" or not params.get("mscale_all_dim"):
        return 1.0
    m = yarn_mscale(_yarn_factor(params, max_position), float(params["mscale_all_dim"]))
    return m * m


class RotaryEmbedding(nn.Module):
    """Looks up cos/sin for positions from a table grown on demand (fp32, computed once)."""

    def __init__(self, head_dim: int, params: JSONObject, max_position: int,
                 device: torch.device | None = None):
        super().__init__()
        self.head_dim = head_dim
        self.max_position = max_position
        self.inv_freq = inv_frequencies(head_dim, params, max_position).to(device)
        self.scale = attention_factor(params, max_position)  # YaRN's; 1 otherwise
        self._cos: torch.Tensor | None = None
        self._sin: torch.Tensor | None = None
        # The whole table when it is small (up to 4M entries), so that lookups never sync.
        self._grow(min(max_position, max(4096, (1 << 22) // max(1, head_dim))))

    def _grow(self, n: int) -> None:
        t = torch.arange(n, dtype=torch.float32, device=self.inv_freq.device)
        freqs = torch.outer(t, self.inv_freq)  # [n, D/2]; the product HF computes, in fp32
        cos, sin = freqs.cos(), freqs.sin()
        if self.scale != 1.0:
            cos, sin = cos * self.scale, sin * self.scale
        self._cos = torch.cat((cos, cos), dim=-1)  # [n, D]
        self._sin = torch.cat((-sin, sin), dim=-1)

    def cover_all_positions(self) -> None:
        """Grow the table to the whole context now, so lookups never read positions on the host
        (CUDA-graph capture calls this: a sync inside a capture is an error)."""
        if self._cos.shape[0] < self.max_position:
            self._grow(self.max_position)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin: [T, 1, D] in `dtype` for positions [T] (computed once per forward).

        Full width, with the sign of rotate_half folded into sin: cos = [c, c], sin = [-s, s].
        """
        # Growing needs the largest position on the host: only checked while the table is
        # shorter than the model's context (long-context models), never otherwise.
        if positions.numel() and self._cos.shape[0] < self.max_position:
            top = int(positions.max()) + 1
            if top > self._cos.shape[0]:
                self._grow(max(top, 2 * self._cos.shape[0]))
        cos = self._cos[positions].to(dtype).unsqueeze(1)
        sin = self._sin[positions].to(dtype).unsqueeze(1)
        return cos, sin


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, D] (any strides) -> rotated copy; HF's x*cos + rotate_half(x)*sin.

    With cos/sin from `cos_sin`, rotate_half(x)*sin is roll(x, D/2)*[-s, s]: three ops.
    """
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), sin)
