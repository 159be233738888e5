"""Where reading a model costs time on a new machine (issue 37's cold start): one fresh process,
an empty model cache, then each step timed in order.

    python bench/read_model_timing.py

It builds bench_serving's Llama-3.1-8B model directory (config.json and a word-level tokenizer of
128,256 tokens), then times: torch's import, the model spec (core.plan.model_spec: the first
transformers import is in here), the config (core.engine.loader), transformers' tokenizer, the
tokenizer record, and the engine's tokenizer from an empty cache and from a filled one. A
diagnostic, not a benchmark: no ceiling, just where the seconds go on this machine.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]


def main() -> int:
    os.environ["CORE_GGUF_CACHE"] = tempfile.mkdtemp(prefix="read_model_cache_")
    from core.plan.hf_imports import keep_torchvision_out

    keep_torchvision_out()  # as the `core` command and the engine workers do
    marks = [("start", time.perf_counter())]

    def mark(what: str) -> None:
        marks.append((what, time.perf_counter()))
        print(f"{what}: {marks[-1][1] - marks[-2][1]:.2f} s", flush=True)

    import torch  # noqa: F401

    mark("import torch")
    from bench_serving import LLAMA_31_8B, make_model_dir

    d = make_model_dir(dict(LLAMA_31_8B))
    mark("model directory written")
    from core.plan.model_spec import load_model_spec

    load_model_spec(d)
    mark("model spec (transformers imported here)")
    from core.engine.loader import find_weights, load_config, load_tokenizer

    load_config(find_weights(d, "dummy"))
    mark("config")
    from core.tokenizer import _hf_tokenizer, tokenizer_record

    hf = _hf_tokenizer(d, None)
    mark("transformers' tokenizer")
    tokenizer_record(hf)
    mark("tokenizer record")
    from core.plan.args import make_server_args

    args = make_server_args(model_path=d, load_format="dummy")
    load_tokenizer(args)
    mark("engine tokenizer, empty cache")
    load_tokenizer(args)
    mark("engine tokenizer, from the cache")
    print(f"total: {marks[-1][1] - marks[0][1]:.2f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
