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
"""

from __future__ import annotations

import math
from typing import Any


def shapes(cfg: dict[str, Any]) -> dict[str, int]:
    h = cfg["hidden_size"]
    heads = cfg["num_attention_heads"]
    d = cfg.get("head_dim") or h // heads
    kv = cfg.get("num_key_value_heads") or heads
    experts = cfg.get("num_experts") or cfg.get("num_local_experts") or 0
    inter = (cfg.get("moe_intermediate_size") or cfg["intermediate_size"]) if experts \
        else cfg["intermediate_size"]
    return {"h": h, "heads": heads, "d": d, "kv": kv, "layers": cfg["num_hidden_layers"],
            "vocab": cfg["vocab_size"], "experts": experts,
            "top_k": cfg.get("num_experts_per_tok") or 0, "inter": inter,
            "shared": cfg.get("shared_expert_intermediate_size") or 0}


def per_layer_params(cfg: dict[str, Any]) -> dict[str, int]:
    """Weights of one decoder layer: attention projections, router, one expert (or the dense
    MLP), the shared expert."""
    s = shapes(cfg)
    attn = s["h"] * (s["heads"] + 2 * s["kv"]) * s["d"] + s["heads"] * s["d"] * s["h"]
    mlp = 3 * s["h"] * s["inter"]
    router = s["h"] * s["experts"]
    shared = 3 * s["h"] * s["shared"] + (s["h"] if s["shared"] else 0)
    return {"attn": attn, "expert": mlp, "router": router, "shared": shared}


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
    active_mlp = (s["top_k"] * p["expert"] + p["router"] + p["shared"]) if s["experts"] \
        else p["expert"]
    per_token = L * (p["attn"] + active_mlp)
    return sum(2 * per_token * n + 4 * L * s["heads"] * s["d"] * n * (n + 1) / 2
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
    kv_per_token = 2 * L * s["kv"] * s["d"] * elem_bytes
    left = requests
    for _ in range(waves):
        b = min(left, max_running)
        left -= b
        mlp = (distinct_experts(s["experts"], s["top_k"], b) * p["expert"] + p["router"]
               + p["shared"]) if s["experts"] else p["expert"]
        weights = (L * (p["attn"] + mlp) + s["h"] * s["vocab"]) * elem_bytes
        # the batch's KV read once a step, contexts growing from input_len to + output_len
        kv = b * kv_per_token * output_len * (input_len + output_len / 2)
        decode_bytes += output_len * weights + kv
    prefill_s = prefill_flops / matmul_flops
    decode_s = decode_bytes / copy_bytes_s
    return {"floor_s": prefill_s + decode_s, "prefill_s": prefill_s, "decode_s": decode_s,
            "prefill_flops": prefill_flops, "decode_bytes": decode_bytes, "waves": waves}
