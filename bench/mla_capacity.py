"""KV capacity of an MLA model: tokens the engine's latent pool holds, against what a per-head
(materialised K and V) cache of the same model would hold in the same bytes.

    python bench/mla_capacity.py [--config tests/fixtures/configs/deepseek-v2-lite.json]
                                 [--device cuda] [--mem-fraction-static 0.85] [--out cap.json]

The engine is built as `core serve` builds it (dummy weights of the config, the KV pool sized
from the device's free memory by the hardware plugin), and reports its pool: tokens, bytes per
token (one latent row of kv_lora_rank + qk_rope_head_dim values a layer). The materialised
figure divides the same pool bytes by num_layers * heads * (qk_nope + qk_rope + v) values a
token, the cache a per-head backend would keep.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=str(ROOT / "tests/fixtures/configs/deepseek-v2-lite.json"))
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--mem-fraction-static", type=float, default=None)
    p.add_argument("--max-total-tokens", type=int, default=None)
    p.add_argument("--out", default=None)
    a = p.parse_args()

    import torch

    sys.path.insert(0, str(ROOT / "tests"))
    from model_fixtures import write_config_model

    from core.engine.memory.kv_cache import KVPool
    from core.engine.worker import build_engine_core, make_plan
    from core.plan.args import make_server_args

    cfg = json.loads(Path(a.config).read_text())
    kw = {k: v for k, v in (("mem_fraction_static", a.mem_fraction_static),
                            ("max_total_tokens", a.max_total_tokens)) if v is not None}
    with tempfile.TemporaryDirectory() as tmp:
        path = write_config_model(Path(tmp) / "model", cfg)
        args, plan, spec, registry = make_plan(make_server_args(
            model_path=path, load_format="dummy", dtype=a.dtype, device=a.device, **kw))
        core = build_engine_core(args, plan, spec, registry)
        info = core.info
    dtype = getattr(torch, a.dtype)
    layers, heads = cfg["num_hidden_layers"], cfg["num_attention_heads"]
    qk = cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]
    full = KVPool.bytes_per_token(layers, heads, qk, dtype, v_head_dim=cfg["v_head_dim"])
    pool_bytes = info.pool_tokens * info.kv_bytes_per_token
    report = {"config": Path(a.config).name, "device": info.device,
              "attention": plan.decode_attention, "pool_tokens": info.pool_tokens,
              "latent_bytes_per_token": info.kv_bytes_per_token, "pool_bytes": pool_bytes,
              "materialised_bytes_per_token": full,
              "materialised_tokens_same_bytes": pool_bytes // full,
              "ratio": info.kv_bytes_per_token and full / info.kv_bytes_per_token,
              "notes": list(info.notes)}
    print(json.dumps(report, indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
