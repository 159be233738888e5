"""Per-step cost of structured output, per grammar backend, on the embedded model's vocabulary.

    python bench/bench_grammar.py [--out grammar.json]

For each registered grammar backend and a few constraints (a JSON schema, JSON object, a regex,
a choice), one matcher walks a fixed valid output token by token; each step times
`fill_bitmask` (the backend's mask for the next token), `apply_bitmask` (core's masking of one
row of SmolLM2's 49,152 logits) and `accept`. The peer in the same run: one batch-1 decode step
of SmolLM2 itself (the engine's torch path on this machine, fp32), so "of a step" reads as the
share of a decode step that structured output would add if nothing overlapped. Compile time
(first use of a constraint, cached afterwards) is reported separately.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

CONSTRAINTS = {
    "json_schema": ("json_schema", json.dumps({
        "type": "object", "properties": {"name": {"type": "string"},
                                         "age": {"type": "integer"},
                                         "tags": {"type": "array", "items": {"type": "string"}}},
        "required": ["name", "age", "tags"], "additionalProperties": False}),
        '{"name":"Ada Lovelace","age":36,"tags":["math","engines"]}'),
    "json_object": ("json_object", "", '{"city":"Paris","population":2102650}'),
    "regex": ("regex", r"\d{3}-\d{3}-\d{4}", "555-867-5309"),
    "choice": ("choice", json.dumps(["positive", "negative", "neutral"]), "neutral"),
}


def decode_step_s(loaded) -> float:
    """Median seconds of one batch-1 decode step of the loaded model (torch_native path)."""
    sys.path.insert(0, str(REPO / "tests"))
    from model_fixtures import PagedHarness, torch_native_backend

    cfg = loaded.hf_config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    h = PagedHarness(cfg.num_hidden_layers, cfg.num_key_value_heads, head_dim, 4,
                     num_pages=128, max_context=512, backend=torch_native_backend(cfg))
    model = loaded.model
    with torch.inference_mode():
        b = h.batch([0], [list(range(10, 42))])
        model.compute_logits(model(b.input_ids, b.positions, b))
        times = []
        for i in range(24):
            b = h.batch([0], [[100 + i]], decode=True)
            t = time.perf_counter()
            model.compute_logits(model(b.input_ids, b.positions, b))
            times.append(time.perf_counter() - t)
    return statistics.median(times[4:])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None)
    a = p.parse_args()
    sys.path.insert(0, str(REPO / "tests"))
    from model_fixtures import cpu_plan

    from core.contract.grammar import Constraint, apply_bitmask, make_grammar
    from core.engine.loader import load_model
    from core.plan.args import make_server_args
    from core.plan.registry import get_registry

    registry = get_registry()
    loaded = load_model(make_server_args(), cpu_plan("llama"), registry)
    tok, vocab = loaded.tokenizer, loaded.hf_config.vocab_size
    step = decode_step_s(loaded)
    rows = []
    logits = torch.zeros(1, vocab)
    for name in sorted(registry.kind("grammar")):
        try:
            grammar = make_grammar(registry, name, tok, vocab, sorted(tok.eos_token_ids))
        except Exception as exc:  # noqa: BLE001 - a missing package loses one backend
            rows.append({"backend": name, "error": f"{type(exc).__name__}: {exc}"[:200]})
            continue
        for label, (kind, value, text) in CONSTRAINTS.items():
            c = Constraint(kind, value)
            t = time.perf_counter()
            try:
                grammar.compiled_for(c)
            except Exception as exc:  # noqa: BLE001 - a constraint the backend refuses
                rows.append({"backend": name, "constraint": label, "error": str(exc)[:200]})
                continue
            compile_s = time.perf_counter() - t
            m = grammar.matcher(c)
            ids = tok.encode(text) + [min(tok.eos_token_ids)]
            bitmask = torch.zeros(1, (vocab + 31) // 32, dtype=torch.int32)
            fill, mask, accept = [], [], []
            for token in ids:
                t0 = time.perf_counter()
                m.fill_bitmask(bitmask, 0)
                t1 = time.perf_counter()
                apply_bitmask(logits, bitmask, [0])
                t2 = time.perf_counter()
                ok = m.accept(token)
                t3 = time.perf_counter()
                fill.append(t1 - t0)
                mask.append(t2 - t1)
                accept.append(t3 - t2)
                if not ok:
                    break
            m.close()
            per = statistics.median(fill) + statistics.median(mask) + statistics.median(accept)
            rows.append({"backend": name, "constraint": label, "tokens": len(fill),
                         "compile_ms": compile_s * 1e3,
                         "fill_us": statistics.median(fill) * 1e6,
                         "apply_us": statistics.median(mask) * 1e6,
                         "accept_us": statistics.median(accept) * 1e6,
                         "of_decode_step": per / step, "walked_to_end": ok})
            logits.zero_()
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                if line.startswith("model name")), "cpu")
    report = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpu": cpu,
              "torch": torch.__version__, "decode_step_ms": step * 1e3, "rows": rows}
    print(f"SmolLM2 batch-1 decode step (torch path, fp32): {step * 1e3:.1f} ms on {cpu}")
    print("| backend | constraint | compile ms | fill us | apply us | accept us | of a step |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['backend']} | {r.get('constraint', '-')} | error: {r['error']} |")
            continue
        print(f"| {r['backend']} | {r['constraint']} | {r['compile_ms']:.1f} | "
              f"{r['fill_us']:.0f} | {r['apply_us']:.0f} | {r['accept_us']:.0f} | "
              f"{r['of_decode_step']:.3f} |")
    if a.out:
        Path(a.out).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
