"""Accuracy of the online quant methods on a real model: SmolLM2-135M quantized at load with
each method, against its own fp32 run on a fixed English text (tests/fixtures/text).

Bounds (perplexity ratio to fp32, greedy next-token agreement over the text's positions) are
set from measurement with margin; the measured values are printed (-s) and noted in
bench/RESULTS.md. The fp32 run itself is checked against transformers in test_loader.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from model_fixtures import cpu_plan, prefill_logits

from core.engine.loader import load_model
from core.plan.args import make_server_args
from core.plan.registry import build_registry

TEXT = (Path(__file__).parent / "fixtures" / "text" / "perplexity.txt").read_text()
# method -> (online format, max perplexity ratio to fp32, min greedy agreement)
BOUNDS = {"fp8": ("fp8_channel", 1.05, 0.85), "w8a8_int8": ("int8_channel", 1.05, 0.85)}


@pytest.fixture(scope="module")
def runs():
    registry = build_registry()
    out = {}
    for name, fmt in [("unquantized", "dense")] + [(n, b[0]) for n, b in BOUNDS.items()]:
        plan = dataclasses.replace(cpu_plan("llama"), quant_method=name, quant_format=fmt)
        loaded = load_model(make_server_args(), plan, registry)
        ids = loaded.tokenizer.encode(TEXT)
        logits = prefill_logits(loaded.model, loaded.hf_config, ids).float()
        out[name] = (ids, logits)
    return out


def _perplexity(ids, logits) -> float:
    nll = torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(ids[1:]))
    return float(torch.exp(nll))


@pytest.mark.parametrize("method", sorted(BOUNDS))
def test_online_quantization_keeps_perplexity(runs, method):
    ids, ref = runs["unquantized"]
    _, logits = runs[method]
    base, ppl = _perplexity(ids, ref), _perplexity(ids, logits)
    agree = float((logits.argmax(-1) == ref.argmax(-1)).float().mean())
    _, max_ratio, min_agree = BOUNDS[method]
    print(f"\n{method}: perplexity {ppl:.3f} vs fp32 {base:.3f} (x{ppl / base:.4f}), greedy "
          f"agreement {agree:.3f} over {len(ids) - 1} positions")
    assert len(ids) > 150
    assert ppl / base <= max_ratio and agree >= min_agree
    assert not torch.equal(logits, ref)  # the method did quantize


def test_core_serve_with_online_quantization_answers():
    """`core serve --quantization w8a8_int8` on the embedded model: the plan names the method
    and its format, and a chat completion through the HTTP server answers sensibly."""
    import json
    import os
    import subprocess
    import sys

    from conformance.server_kit import free_port, http_request, read_until_listening

    port = free_port()
    cmd = [sys.executable, "-m", "core.cli", "serve", "--port", str(port), "--max-total-tokens",
           "2048", "--quantization", "w8a8_int8"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        out = read_until_listening(proc)
        assert "w8a8_int8 (int8_channel)" in out, out
        status, _, raw = http_request(f"http://127.0.0.1:{port}", "POST",
                                      "/v1/chat/completions", {
                                          "messages": [{"role": "user", "content":
                                                        "What is the capital of France?"}],
                                          "max_tokens": 16, "temperature": 0}, {}, timeout=120)
        assert status == 200, raw
        assert "Paris" in json.loads(raw)["choices"][0]["message"]["content"]
    finally:
        proc.terminate()
        proc.wait(timeout=60)
