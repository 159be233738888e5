"""Lower bounds on the time of an offline run, from a model config and the same run's ceilings
(issue 13's offline target: "prefill FLOPs at the measured matmul rate + decode bytes at the
measured copy bandwidth"). Dense and MoE decoders (Llama, Qwen2/3, Mixtral, Qwen-MoE shapes).

Prefill: 2 FLOPs per active weight per prompt token (a MoE token multiplies through top_k
experts, not all), plus causal attention's QK^T and PV (4 * heads * head_dim * position per
layer and token), plus the LM head once per request (its last position). Decode: each of the
run's decode steps reads the attention and router weights, the experts its batch touches
(the expected number of distinct experts that B tokens x top_k picks hit, uniform routing),
the LM head, and the KV cache of every running request. Steps: output_len per wave of at most
max_running requests. Everything else (norms, sampling, the host) is taken as free, so the
floor is optimistic and a measured run can only approach it.

DeepSeek-V2/V3 configs (kv_lora_rank set): MLA's projections (q or q_a/q_b, kv_a, kv_b, o), a
latent KV row of kv_lora_rank + rope dims a token and layer, prefill attention over the
materialised heads (QK^T over nope + rope dims, PV over v dims), n_routed_experts with
n_shared_experts * moe_intermediate_size of shared MLP, and the first first_k_dense_replace
layers dense (intermediate_size).
"""

from __future__ import annotations

import math
from typing import Any


def shapes(cfg: dict[str, Any]) -> dict[str, int]:
    h = cfg["hidden_size"]
    heads = cfg["num_attention_heads"]
    d = cfg.get("head_dim") or h // heads
    kv = cfg.get("num_key_value_heads") or heads
    experts = (cfg.get("num_experts") or cfg.get("num_local_experts")
               or cfg.get("n_routed_experts") or 0)
    inter = (cfg.get("moe_intermediate_size") or cfg["intermediate_size"]) if experts \
        else cfg["intermediate_size"]
    shared = cfg.get("shared_expert_intermediate_size") or \
        (cfg.get("n_shared_experts") or 0) * inter
    return {"h": h, "heads": heads, "d": d, "kv": kv, "layers": cfg["num_hidden_layers"],
            "vocab": cfg["vocab_size"], "experts": experts,
            "top_k": cfg.get("num_experts_per_tok") or 0, "inter": inter, "shared": shared,
            # DeepSeek: its first layers keep a dense MLP
            "dense_layers": (cfg.get("first_k_dense_replace") or 0) if experts else 0,
            "mla": int(bool(cfg.get("kv_lora_rank")))}


def attn_params(cfg: dict[str, Any]) -> int:
    """Attention projection weights of one layer (GQA, or DeepSeek's MLA)."""
    s = shapes(cfg)
    h, H = s["h"], s["heads"]
    if not s["mla"]:
        return h * (H + 2 * s["kv"]) * s["d"] + H * s["d"] * h
    dn, dr, dv = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    r, qr = cfg["kv_lora_rank"], cfg.get("q_lora_rank")
    q = h * H * (dn + dr) if not qr else h * qr + qr * H * (dn + dr)
    return q + h * (r + dr) + r * H * (dn + dv) + H * dv * h


def kv_bytes_per_token(cfg: dict[str, Any], elem_bytes: int) -> int:
    """KV cache bytes of one token over all layers: K and V per KV head, or MLA's latent row."""
    s = shapes(cfg)
    if s["mla"]:
        return s["layers"] * (cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]) * elem_bytes
    return 2 * s["layers"] * s["kv"] * s["d"] * elem_bytes


def per_layer_params(cfg: dict[str, Any]) -> dict[str, int]:
    """Weights of one decoder layer: attention projections, router, one expert (or the dense
    MLP), the shared expert; `dense`: the MLP of a MoE model's dense layers."""
    s = shapes(cfg)
    mlp = 3 * s["h"] * s["inter"]
    router = s["h"] * s["experts"]
    # Qwen-MoE's shared expert has a sigmoid gate; DeepSeek's shared experts have none
    gate = s["h"] if cfg.get("shared_expert_intermediate_size") else 0
    shared = 3 * s["h"] * s["shared"] + gate
    return {"attn": attn_params(cfg), "expert": mlp, "router": router, "shared": shared,
            "dense": 3 * s["h"] * cfg["intermediate_size"]}


def _mlp_params(s: dict[str, int], p: dict[str, int], routed_experts: float) -> float:
    """MLP weights of all layers when each MoE layer reads `routed_experts` experts."""
    if not s["experts"]:
        return s["layers"] * p["expert"]
    moe = routed_experts * p["expert"] + p["router"] + p["shared"]
    return s["dense_layers"] * p["dense"] + (s["layers"] - s["dense_layers"]) * moe


def distinct_experts(experts: int, top_k: int, tokens: int) -> float:
    """Expected distinct experts that `tokens` tokens' top_k picks touch (uniform routing)."""
    if not experts:
        return 0.0
    miss = (1 - top_k / experts) ** tokens
    return experts * (1 - miss)


def prefill_flops_of(cfg: dict[str, Any], prompt_lens: list[int]) -> float:
    """FLOPs of prefilling prompts of these lengths: 2 per active weight per token (a MoE token
    through its top_k experts, router and shared expert), causal attention's QK^T and PV
    (4 * heads * head_dim per visible position, layer and token), and the LM head once per
    prompt (its last position)."""
    s, p = shapes(cfg), per_layer_params(cfg)
    L = s["layers"]
    per_token = L * p["attn"] + _mlp_params(s, p, s["top_k"])
    # QK^T and PV per head and visible position: 2 * (qk dims + v dims)
    qkv = (cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"] + cfg["v_head_dim"]) \
        if s["mla"] else 2 * s["d"]
    return sum(2 * per_token * n + 2 * L * s["heads"] * qkv * n * (n + 1) / 2
               + 2 * s["h"] * s["vocab"] for n in prompt_lens)


def offline_floor(cfg: dict[str, Any], requests: int, input_len: int, output_len: int,
                  max_running: int, matmul_flops: float, copy_bytes_s: float,
                  elem_bytes: int = 2) -> dict[str, float]:
    """Seconds of the floor (prefill at the matmul rate + decode at the copy rate), and its
    parts. matmul_flops: FLOP/s of the same run's GEMM; copy_bytes_s: its copy bandwidth."""
    s, p = shapes(cfg), per_layer_params(cfg)
    L = s["layers"]
    prefill_flops = prefill_flops_of(cfg, [input_len] * requests)
    waves = math.ceil(requests / max(1, min(max_running, requests)))
    decode_bytes = 0.0
    kv_per_token = kv_bytes_per_token(cfg, elem_bytes)
    left = requests
    for _ in range(waves):
        b = min(left, max_running)
        left -= b
        mlp = _mlp_params(s, p, distinct_experts(s["experts"], s["top_k"], b))
        weights = (L * p["attn"] + mlp + s["h"] * s["vocab"]) * elem_bytes
        # the batch's KV read once a step, contexts growing from input_len to + output_len
        kv = b * kv_per_token * output_len * (input_len + output_len / 2)
        decode_bytes += output_len * weights + kv
    prefill_s = prefill_flops / matmul_flops
    decode_s = decode_bytes / copy_bytes_s
    return {"floor_s": prefill_s + decode_s, "prefill_s": prefill_s, "decode_s": decode_s,
            "prefill_flops": prefill_flops, "decode_bytes": decode_bytes, "waves": waves}
