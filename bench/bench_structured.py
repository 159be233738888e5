"""Structured-output throughput: JSON-schema constrained decoding against unconstrained decoding
of the same engine in the same run, per grammar backend.

    python bench/bench_structured.py --out structured.json          # H200: Llama-3.1-8B shapes
    python bench/bench_structured.py --scenario cpu                 # this CPU: embedded SmolLM2

GPU scenario: Llama-3.1-8B shapes, dummy bf16 weights, and a byte-level tokenizer of the real
vocabulary size (128,256: the 256 byte tokens, then generated multi-byte pieces: JSON
punctuation, digits, words; grammar backends need tokens that spell text). CPU scenario: the
embedded SmolLM2-135M (its own tokenizer, GGUF blocks). For each installed backend: batch 1 and
`--concurrency` requests at once, each unconstrained (EOS ignored) and then constrained by the
schema (greedy; its 200-item array keeps every request going to --output-len), on fresh
prompts each time (no prefix-cache hits). Figures are
output tokens per second over the wall time, and the constrained / unconstrained ratio; beside
them the grammar-mask time the engine reports (stats mask_fill_s / mask_wait_s) and the share
of it hidden behind the forward (1 - wait / fill: the masks fill on a host thread while the
forward runs, core.engine.sampling.Sampler.start_masks).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))
sys.path.insert(0, str(BENCH_DIR.parent))

# minItems keeps a request going to --output-len (a JSON finished early would make its
# throughput incomparable with the unconstrained run's, whose requests all run the full length)
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"},
    "tags": {"type": "array", "items": {"type": "string"}, "minItems": 200}},
    "required": ["name", "age", "tags"]}
PIECES = ('{"', '":', '",', '"}', ' "', '": "', '["', '"]', "true", "false", "null", ", ", "\\n",
          "the", "and", "ing", "tion", " of", " to", " in", " is", "name", "age", "bio", "tags")


def write_bytelevel_tokenizer(path: Path, vocab_size: int) -> int:
    """A byte-level BPE tokenizer of `vocab_size` tokens: GPT-2's 256 byte symbols, JSON and
    word pieces, random letter runs, and one special EOS token, the last id (returned). It has
    no merges,
    so it encodes byte by byte, but every id decodes to its own text, which is what a grammar
    backend reads."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    space = "\u0120"  # GPT-2's symbol for the space byte
    pieces = list(pre_tokenizers.ByteLevel.alphabet())  # the 256 byte symbols
    pieces += [p.replace(" ", space) for p in PIECES]
    rng = random.Random(0)
    letters = "abcdefghijklmnopqrstuvwxyz0123456789"
    seen = set(pieces)
    while len(pieces) < vocab_size - 1:
        word = (space if rng.random() < 0.5 else "") + "".join(
            rng.choice(letters) for _ in range(rng.randint(2, 7)))
        if word not in seen:
            seen.add(word)
            pieces.append(word)
    tok = Tokenizer(models.BPE(vocab={p: i for i, p in enumerate(pieces)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|eot_id|>"])  # the next id: vocab_size - 1
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|eot_id|>").save_pretrained(
        str(path))
    return vocab_size - 1


def engine_kwargs(gpu: bool, cpu_tokens: int, prefix: str) -> dict[str, Any]:
    """core.Engine keywords of a scenario: the GPU's Llama-3.1-8B shapes (dummy bf16 weights,
    the byte-level tokenizer of the real vocabulary size, in a new directory), or the CPU's
    embedded model with a KV pool of cpu_tokens."""
    if not gpu:
        return {"device": "cpu", "max_total_tokens": cpu_tokens}
    from conformance.model_configs import LLAMA_31_8B

    cfg = dict(LLAMA_31_8B)
    model = Path(tempfile.mkdtemp(prefix=prefix))
    cfg["eos_token_id"] = write_bytelevel_tokenizer(model, cfg["vocab_size"])
    (model / "config.json").write_text(json.dumps(cfg))
    return {"model_path": str(model), "load_format": "dummy", "dtype": "bfloat16",
            "device": "cuda"}


def write_report(report: dict[str, Any], out: str | None, shown: int = 4000) -> None:
    """Print the report's JSON (its first `shown` characters) and write it whole to out."""
    print(json.dumps(report, indent=1, default=str)[:shown])
    if out:
        Path(out).write_text(json.dumps(report, indent=1, default=str))


def prompts(rng: random.Random, n: int, length: int, vocab: int) -> list[list[int]]:
    lo = min(1000, vocab // 4)
    return [[rng.randrange(lo, vocab - 1) for _ in range(length)] for _ in range(n)]


def run(engine: Any, prompts: list[list[int]], out_len: int, constrained: bool
        ) -> dict[str, Any]:
    sp: dict[str, Any] = {"temperature": 0, "max_new_tokens": out_len}
    if constrained:
        sp["constraint"] = {"kind": "json_schema", "value": json.dumps(SCHEMA)}
    else:
        sp["ignore_eos"] = True
    s0 = engine.stats()
    t = time.perf_counter()
    outs = engine.generate(input_ids=prompts, sampling_params=sp)
    wall = time.perf_counter() - t
    s1 = engine.stats()
    tokens = sum(len(o["output_ids"]) for o in outs)
    fill = s1.get("mask_fill_s", 0.0) - s0.get("mask_fill_s", 0.0)
    wait = s1.get("mask_wait_s", 0.0) - s0.get("mask_wait_s", 0.0)
    res = {"requests": len(prompts), "output_tokens": tokens, "wall_s": wall,
           "output_tok_s": tokens / wall}
    if constrained:
        res.update(mask_fill_s=fill, mask_wait_s=wait,
                   mask_hidden=(1 - wait / fill) if fill > 0 else None,
                   sample=engine.tokenizer.decode(outs[0]["output_ids"][:60]))
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--scenario", choices=("gpu", "cpu"), default="gpu")
    p.add_argument("--backends", default=None, help="comma list (default: every registered)")
    p.add_argument("--concurrency", type=int, default=None, help="default 64 (GPU), 8 (CPU)")
    p.add_argument("--output-len", type=int, default=None, help="default 256 (GPU), 48 (CPU)")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    gpu = a.scenario == "gpu"
    if gpu and not torch.cuda.is_available():
        print("skipped: the gpu scenario needs CUDA (try --scenario cpu)")
        return 0
    conc = a.concurrency or (64 if gpu else 8)
    out_len = a.output_len or (256 if gpu else 48)
    from core import Engine
    from core.plan.registry import get_registry

    registry = get_registry()
    backends = a.backends.split(",") if a.backends else sorted(registry.kind("grammar"))
    kw = engine_kwargs(gpu, 8192, "bench_structured_")
    report: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "device": torch.cuda.get_device_name() if gpu else "cpu", "torch": torch.__version__,
        "concurrency": conc, "output_len": out_len, "input_len": a.input_len, "backends": {}}
    rng = random.Random(0)
    for name in backends:
        t = time.perf_counter()
        try:
            engine = Engine(grammar_backend=name, **kw)
        except Exception as exc:  # noqa: BLE001 - a backend whose package is missing
            report["backends"][name] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
            print(f"{name}: {report['backends'][name]['error']}", flush=True)
            continue
        with engine:
            vocab = engine.info.vocab_size
            run(engine, prompts(rng, 2, a.input_len, vocab), 8, False)  # warm-up
            run(engine, prompts(rng, 2, a.input_len, vocab), 8, True)  # (and the compile)
            res = {"startup_s": time.perf_counter() - t}
            for label, n in (("batch1", 1), (f"batch{conc}", conc)):
                # fresh prompts each: a repeated one would be a prefix-cache hit
                free = run(engine, prompts(rng, n, a.input_len, vocab), out_len, False)
                cons = run(engine, prompts(rng, n, a.input_len, vocab), out_len, True)
                res[label] = {"unconstrained": free, "constrained": cons,
                              "ratio": cons["output_tok_s"] / free["output_tok_s"]}
                hidden = cons.get("mask_hidden")
                print(f"{name} {label}: {cons['output_tok_s']:.1f} / {free['output_tok_s']:.1f} "
                      f"tok/s = {res[label]['ratio']:.3f}; masks {cons['mask_fill_s']:.3f} s, "
                      f"hidden {hidden if hidden is None else round(hidden, 3)}", flush=True)
            report["backends"][name] = res
    write_report(report, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
