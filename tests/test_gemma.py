"""Gemma 2 and Gemma 3 (text) through the whole engine: the resolver plans them on the CPU (a
backend with soft-caps and windows), the worker serves them, and greedy answers past the sliding
window equal transformers' own greedy generation (fp32). Per-step logits against HF are in
tests/test_models.py."""

from __future__ import annotations

import pytest
import torch
from hf_compare import hf_greedy
from model_fixtures import SLIDING_WINDOW, tiny_hf_model, write_tiny_model

import core

NEW = 12


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_greedy_past_the_window_matches_transformers(arch, tmp_path):
    path = write_tiny_model(arch, tmp_path / arch)
    hf = tiny_hf_model(arch)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist()
               for n in (2 * SLIDING_WINDOW + 3, 5, SLIDING_WINDOW)]
    want = [hf_greedy(hf, p, NEW) for p in prompts]
    with core.Engine(str(path), dtype="float32", max_total_tokens=512, page_size=4) as engine:
        assert engine.plan.model_impl == arch
        outs = engine.generate(input_ids=prompts, sampling_params={
            "temperature": 0, "max_new_tokens": NEW, "ignore_eos": True})
    assert [o["output_ids"] for o in outs] == want


def test_resolve_gemma2_names_a_soft_capping_backend():
    """Gemma-2-9B's real config plans on the h200 and x86-cpu profiles with a backend that
    declares soft-caps and windows (before the model landed: 'no model implementation')."""
    from pathlib import Path

    from core.plan.args import make_server_args
    from core.plan.devices import select_device
    from core.plan.model_spec import load_model_spec
    from core.plan.registry import get_registry
    from core.plan.resolver import resolve

    cfg = Path(__file__).parent / "fixtures" / "configs" / "gemma-2-9b.json"
    spec = load_model_spec(str(cfg))
    registry = get_registry()
    for profile in ("h200", "x86-cpu"):
        plan = resolve(spec, select_device(registry, profile=profile), make_server_args(
            model_path=str(cfg), device_profile=profile), registry)
        assert plan.model_impl == "gemma2"
        caps = registry.get("attention", plan.decode_attention).caps
        assert caps.logit_softcap and caps.sliding_window, plan.decode_attention
