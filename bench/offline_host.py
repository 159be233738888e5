"""Offline throughput where the host's per-step work dominates: a tiny random Llama on the CPU.

    python bench/offline_host.py                       # 256 prompts x (64 in, 128 out), 3 repeats
    python bench/offline_host.py --num-prompts 256 --output-len 128 --repeats 5 --stream
    python bench/offline_host.py --profile-worker /tmp/w.txt   # + py-spy of the worker

The model (hidden 64, 2 layers, vocab 4096, --load-format dummy) keeps the forward to a few ms
per decode step at batch 256, the same order as the host's own work per step (scheduler, message
codec, the client's decoding, detokenizing and deltas, the offline Engine's chunks), which a GPU
hides behind a forward only where the overlap schedule chains steps. Besides wall time it reports
the CPU seconds of the worker process and of this (the client) process per step: on a shared
machine those move far less than wall time. It imports `core` as installed (run it with the
interpreter of the tree to measure) and prints one JSON line per repeat, then a summary.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2,
    "num_key_value_heads": 1, "head_dim": 32, "vocab_size": 4096, "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "rope_scaling": None, "hidden_act": "silu",
    "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32",
}


def make_model_dir(d: Path) -> str:
    """config.json + a word-level tokenizer with one plain token per id (every id decodes)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(CONFIG))
    vocab = CONFIG["vocab_size"]
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(str(d))
    return str(d)


def prompts(n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    ids = range(1000, CONFIG["vocab_size"] - 1)
    return [rng.choices(ids, k=length) for _ in range(n)]


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process (all its threads) so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def worker_pid(engine) -> int:
    info = engine.info
    return info["pid"] if isinstance(info, dict) else info.pid


def run(engine, batch: list[list[int]], out_len: int, stream: bool) -> dict:
    sp = {"temperature": 0, "max_new_tokens": out_len, "ignore_eos": True}
    wpid = worker_pid(engine)
    steps0 = engine.stats()["forward_count"]
    w0, c0 = cpu_s(wpid), cpu_s(os.getpid())
    t0 = time.perf_counter()
    tout = 0
    submit = first = None
    if stream:  # bench_serving's offline mode
        chunks = engine.generate(input_ids=batch, sampling_params=sp, stream=True)
        submit = time.perf_counter() - t0  # generate() submits every request, then returns
        for chunk in chunks:
            if first is None:
                first = time.perf_counter() - t0
            tout += len(chunk["token_ids"])
    else:
        for r in engine.generate(input_ids=batch, sampling_params=sp):
            tout += len(r["output_ids"])
    wall = time.perf_counter() - t0
    w1, c1 = cpu_s(wpid), cpu_s(os.getpid())
    steps1 = engine.stats()["forward_count"]
    decode = steps1.get("decode", 0) - steps0.get("decode", 0)
    steps = sum(steps1.values()) - sum(steps0.values())
    return {"output_tokens": tout, "wall_s": round(wall, 3),
            "submit_s": None if submit is None else round(submit, 3),
            "first_chunk_s": None if first is None else round(first, 3),
            "output_tok_s": round(tout / wall, 1), "steps": steps, "decode_steps": decode,
            "worker_cpu_s": round(w1 - w0, 3), "client_cpu_s": round(c1 - c0, 3),
            "worker_cpu_ms_per_step": round((w1 - w0) * 1e3 / max(steps, 1), 3),
            "client_cpu_ms_per_step": round((c1 - c0) * 1e3 / max(steps, 1), 3)}


def py_spy(pid: int, out: str, seconds: float) -> subprocess.Popen | None:
    exe = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(exe).exists():
        print("py-spy not found: no profile", file=sys.stderr)
        return None
    idle = ["--idle"] if os.environ.get("SPY_IDLE") else []  # waits too, not only CPU
    return subprocess.Popen([exe, "record", "-p", str(pid), "-d", str(int(seconds)), "-r", "200",
                             "-f", "raw", "-o", out, *idle], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--stream", action="store_true", help="generate(stream=True), as bench_serving")
    p.add_argument("--engine-extra", default=None, help="more Engine keywords, as JSON")
    p.add_argument("--profile-worker", default=None, metavar="PATH",
                   help="py-spy the worker (raw folded stacks) during the last repeat")
    p.add_argument("--profile-client", default=None, metavar="PATH",
                   help="py-spy this process (raw folded stacks) during the last repeat")
    a = p.parse_args()

    import core
    from core import Engine

    d = Path(tempfile.mkdtemp(prefix="offline_host_"))
    try:
        model = make_model_dir(d)
        kw = {"load_format": "dummy", "device": "cpu", "dtype": "float32",
              "max_running_requests": a.num_prompts,
              "max_total_tokens": a.num_prompts * (a.input_len + a.output_len) + 4096,
              **(json.loads(a.engine_extra) if a.engine_extra else {})}
        with Engine(model, **kw) as engine:
            run(engine, prompts(8, a.input_len, 1), 8, a.stream)  # warm-up
            walls, wcpu, ccpu = [], [], []
            for rep in range(a.repeats):
                spies = []
                if rep == a.repeats - 1:
                    if a.profile_worker:
                        spies.append(py_spy(worker_pid(engine), a.profile_worker, 600))
                    if a.profile_client:
                        spies.append(py_spy(os.getpid(), a.profile_client, 600))
                    if any(spies):
                        time.sleep(1.0)  # py-spy attaches
                res = run(engine, prompts(a.num_prompts, a.input_len, 5 + rep), a.output_len,
                          a.stream)
                for s in spies:
                    if s is not None:
                        s.send_signal(2)  # SIGINT: py-spy writes what it has
                        s.wait(timeout=60)
                walls.append(res["wall_s"])
                wcpu.append(res["worker_cpu_s"])
                ccpu.append(res["client_cpu_s"])
                print(json.dumps({"core": str(Path(core.__file__).parent.parent), "repeat": rep,
                                  "stream": a.stream, **res}), flush=True)
            toks = a.num_prompts * a.output_len
            print(json.dumps({"summary": True, "median_output_tok_s":
                              round(toks / statistics.median(walls), 1),
                              "best_output_tok_s": round(toks / min(walls), 1),
                              "median_worker_cpu_s": statistics.median(wcpu),
                              "median_client_cpu_s": statistics.median(ccpu)}), flush=True)
    finally:
        shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    main()
