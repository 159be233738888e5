"""Jump-forward: JSON-schema constrained decoding with --enable-jump-forward against the same
engine settings without it, in one run, per grammar backend that can jump forward.

    python bench/bench_jump_forward.py --scenario cpu                 # this CPU: SmolLM2
    python bench/bench_jump_forward.py --out jump.json                # H200: Llama-3.1-8B shapes

The schema is a form: many required properties with long fixed names, values enums, bounded
integers, booleans and short strings, so much of each answer is text the grammar forces (keys,
quotes, punctuation, enum tails). Both engines answer the same prompts (greedy); for each the
wall time, the answers per second, the characters of JSON per second, the model's forward
steps (decode tokens), and the tokens jump-forward appended (stats jump_tokens) are reported,
and the ratio of answers per second (jump / plain). Each answer is checked against the schema
(jsonschema, where installed): both must be complete JSON of the schema. GPU scenario: dummy
bf16 weights and bench_structured's byte-level tokenizer of the real vocabulary size (every
text has one tokenization, so the answers of the two engines are the same text); CPU: the
embedded SmolLM2 and its own tokenizer (the forced text is tokenized by the backend, so an
answer may differ from the plain engine's after a jump: the table counts how many are equal).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

import torch

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))
sys.path.insert(0, str(BENCH_DIR.parent))

from bench_structured import engine_kwargs, prompts, write_report  # noqa: E402

FORM = {"type": "object", "additionalProperties": False, "properties": {
    "customer_identifier": {"type": "integer", "minimum": 0, "maximum": 9999},
    "customer_account_status": {"enum": ["active_and_verified", "suspended_pending_review",
                                         "closed_by_request"]},
    "preferred_contact_channel": {"enum": ["electronic_mail", "telephone_call",
                                           "postal_service"]},
    "subscription_is_auto_renewing": {"type": "boolean"},
    "number_of_open_support_tickets": {"type": "integer", "minimum": 0, "maximum": 99},
    "primary_shipping_country_code": {"enum": ["united_states", "united_kingdom", "germany",
                                               "france"]},
    "marketing_consent_was_given": {"type": "boolean"},
    "short_free_text_note": {"type": "string", "maxLength": 16}}}
FORM["required"] = list(FORM["properties"])


def run(engine: Any, batch: list[list[int]], out_len: int) -> dict[str, Any]:
    sp = {"temperature": 0, "max_new_tokens": out_len,
          "constraint": {"kind": "json_schema", "value": json.dumps(FORM)}}
    s0 = engine.stats()
    t = time.perf_counter()
    outs = engine.generate(input_ids=batch, sampling_params=sp)
    wall = time.perf_counter() - t
    s1 = engine.stats()
    texts = [engine.tokenizer.decode(o["output_ids"]) for o in outs]
    valid = 0
    try:
        import jsonschema
    except ImportError:  # counted as unchecked
        jsonschema = None
    for text in texts:
        try:
            doc = json.loads(text)
            if jsonschema is not None:
                jsonschema.validate(doc, FORM)
            valid += 1
        except Exception:  # noqa: BLE001 - an answer that is not JSON of the schema
            pass
    d = {k: s1.get(k, 0) - s0.get(k, 0) for k in ("decode_tokens", "jump_tokens", "jumps")}
    return {"requests": len(batch), "wall_s": wall, "answers_s": len(batch) / wall,
            "json_chars_s": sum(len(t) for t in texts) / wall,
            "output_tokens": sum(len(o["output_ids"]) for o in outs), "valid": valid,
            "checked": jsonschema is not None, **d, "texts": texts}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--scenario", choices=("gpu", "cpu"), default="gpu")
    p.add_argument("--backends", default="xgrammar,llguidance")
    p.add_argument("--concurrency", type=int, default=None, help="default 64 (GPU), 8 (CPU)")
    p.add_argument("--output-len", type=int, default=400)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    gpu = a.scenario == "gpu"
    if gpu and not torch.cuda.is_available():
        print("skipped: the gpu scenario needs CUDA (try --scenario cpu)")
        return 0
    conc = a.concurrency or (64 if gpu else 8)
    from core import Engine

    kw = engine_kwargs(gpu, 16384, "bench_jump_")
    report: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "device": torch.cuda.get_device_name() if gpu else "cpu", "torch": torch.__version__,
        "concurrency": conc, "output_len": a.output_len, "input_len": a.input_len,
        "backends": {}}
    for name in a.backends.split(","):
        res: dict[str, Any] = {}
        for mode, jump in (("plain", False), ("jump", True)):
            try:
                engine = Engine(grammar_backend=name, enable_jump_forward=jump, **kw)
            except Exception as exc:  # noqa: BLE001 - a backend whose package is missing
                res[mode] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
                print(f"{name} {mode}: {res[mode]['error']}", flush=True)
                break
            with engine:
                vocab = engine.info.vocab_size
                rng = random.Random(0)  # the same prompts for both engines
                run(engine, prompts(random.Random(1), 2, a.input_len, vocab), 16)  # warm-up
                res[mode] = {label: run(engine, prompts(rng, n, a.input_len, vocab),
                                        a.output_len)
                             for label, n in (("batch1", 1), (f"batch{conc}", conc))}
        if "error" in res.get("plain", {}) or "error" in res.get("jump", {"error": 1}):
            report["backends"][name] = res
            continue
        for label in res["plain"]:
            pl, jf = res["plain"][label], res["jump"][label]
            jf["ratio_answers_s"] = jf["answers_s"] / pl["answers_s"]
            jf["same_text"] = sum(x == y for x, y in zip(pl["texts"], jf["texts"], strict=True))
            print(f"{name} {label}: jump {jf['answers_s']:.2f} / plain {pl['answers_s']:.2f} "
                  f"answers/s = {jf['ratio_answers_s']:.2f}x; decode steps {jf['decode_tokens']}"
                  f" vs {pl['decode_tokens']}, jump tokens {jf['jump_tokens']}; valid "
                  f"{jf['valid']}/{jf['requests']} vs {pl['valid']}/{pl['requests']}, same "
                  f"text {jf['same_text']}", flush=True)
        report["backends"][name] = res
    write_report(report, a.out, shown=3000)
    return 0


if __name__ == "__main__":
    sys.exit(main())
