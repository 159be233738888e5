"""Batch-1 decode of a MoE model (dummy weights of the real shapes) against its active-weights
roofline: copy bandwidth measured in the same run / bytes read per token (attention, router and
the top-k experts of every layer, the embedding row and the LM head).

    python bench/moe_decode.py --config tests/fixtures/configs/qwen3-30b-a3b.json --out moe.json

Decode tok/s is (new - 1) / (t(new) - t(1)) from two greedy runs of the same prompt, so the
prefill and the first token are not counted; the MoE runner is whatever the plan picked (printed).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def active_bytes_per_token(cfg: dict, dtype_bytes: int = 2) -> int:
    """Weight bytes one decode token reads: every layer's attention and router, top_k experts
    (each gate, up and down of moe_intermediate_size), plus the embedding row and the LM head;
    for DeepSeek configs MLA's projections, n_shared_experts ungated shared experts and the
    first first_k_dense_replace layers' dense MLPs instead of experts.
    An fp8 checkpoint (quantization_config quant_method fp8) holds its projections and experts
    in one byte a weight (block scales: 1/16384 of that, left out); router, embedding and LM
    head stay 16-bit. An mxfp4 checkpoint (GPT-OSS) holds only its experts packed: half a byte
    a weight plus one scale byte per 32 (17/32 of a byte), the rest 16-bit."""
    h = cfg["hidden_size"]
    heads = cfg["num_attention_heads"]
    if cfg.get("kv_lora_rank"):  # DeepSeek's MLA: q (or q_a + q_b), kv_a, kv_b, o
        qk = cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]
        q_rank = cfg.get("q_lora_rank")
        attn = (h * q_rank + q_rank * heads * qk if q_rank else h * heads * qk) \
            + h * (cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]) \
            + cfg["kv_lora_rank"] * heads * (cfg["qk_nope_head_dim"] + cfg["v_head_dim"]) \
            + heads * cfg["v_head_dim"] * h
    else:
        kv = cfg["num_key_value_heads"]
        d = cfg.get("head_dim") or h // heads
        attn = h * (heads + 2 * kv) * d + heads * d * h
    experts = cfg.get("num_experts") or cfg.get("num_local_experts") or cfg["n_routed_experts"]
    top_k = cfg["num_experts_per_tok"]
    inter = cfg.get("moe_intermediate_size") or cfg["intermediate_size"]
    moe = h * experts + top_k * 3 * h * inter
    shared = cfg.get("shared_expert_intermediate_size") or 0
    moe += 3 * h * shared + (h if shared else 0)  # Qwen-MoE: a gated shared expert
    moe += 3 * h * inter * (cfg.get("n_shared_experts") or 0)  # DeepSeek: ungated ones
    method = (cfg.get("quantization_config") or {}).get("quant_method")
    if method == "fp8":
        router = h * experts
        per_layer = (attn + moe - router) / dtype_bytes + router
    elif method == "mxfp4":
        routed = top_k * 3 * h * inter
        per_layer = attn + moe - routed + routed * (17 / 32) / dtype_bytes
    else:
        per_layer = attn + moe
    # DeepSeek's first first_k_dense_replace layers: a dense MLP of intermediate_size
    dense = cfg.get("first_k_dense_replace") or 0
    dense_delta = dense * (3 * h * cfg["intermediate_size"] - moe)
    if method == "fp8":
        dense_delta = dense * (3 * h * cfg["intermediate_size"] - (moe - h * experts)) \
            / dtype_bytes - dense * h * experts
    return int(dtype_bytes * (cfg["num_hidden_layers"] * per_layer + dense_delta + h
                              + cfg["vocab_size"] * h))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=str(ROOT / "tests/fixtures/configs/qwen3-30b-a3b.json"))
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new", type=int, default=256)
    p.add_argument("--extra", default="", help="extra Engine keyword args as JSON")
    p.add_argument("--out", default=None)
    a = p.parse_args()

    import torch

    sys.path.insert(0, str(ROOT / "tests"))
    sys.path.insert(0, str(ROOT / "bench"))
    from ceilings import copy_bandwidth
    from model_fixtures import write_config_model

    from core import Engine

    cfg = json.loads(Path(a.config).read_text())
    device = torch.device("cuda")
    bw = copy_bandwidth(device)  # bytes/s, measured before the engine takes the memory
    model_dir = write_config_model(tempfile.mkdtemp(prefix="moe_"), cfg)
    prompt = [(7 * i + 300) % (cfg["vocab_size"] - 1000) + 500 for i in range(a.prompt_len)]
    extra = json.loads(a.extra) if a.extra else {}
    with Engine(model_dir, load_format="dummy", dtype="bfloat16", max_total_tokens=16384,
                **extra) as engine:
        plan = engine.plan

        def run(n: int) -> float:
            t = time.perf_counter()
            engine.generate(input_ids=prompt, sampling_params={
                "temperature": 0, "max_new_tokens": n, "ignore_eos": True})
            return time.perf_counter() - t

        run(16)  # warm-up: kernels compiled, graphs replayed once
        t1 = min(run(1) for _ in range(3))
        tn = min(run(a.new) for _ in range(2))
        notes = engine.info.notes
    tok_s = (a.new - 1) / (tn - t1)
    active = active_bytes_per_token(cfg)
    roofline = bw / active
    report = {"config": Path(a.config).name, "moe_runner": plan.moe_runner,
              "decode_attention": plan.decode_attention, "layer_ops": plan.layer_ops,
              "graph_capture": plan.cuda_graph, "device": torch.cuda.get_device_name(0),
              "copy_bandwidth_GBps": bw / 1e9, "active_GB_per_token": active / 1e9,
              "roofline_tok_s": roofline, "decode_tok_s": tok_s, "fraction": tok_s / roofline,
              "prefill_plus_first_token_s": t1, "notes": notes}
    print(json.dumps(report, indent=2))
    if a.out:
        Path(a.out).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
