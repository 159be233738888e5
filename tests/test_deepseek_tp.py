"""Tensor parallelism for MLA models (DeepSeek-V2 / V3) on the CPU with gloo, as test_tp runs
it: heads split over the ranks (q / q_b_proj column-parallel, kv_b_proj's rows by head,
o_proj row-parallel), q_a / kv_a projections and norms replicated, the latent cache replicated
on every rank, experts split (or placed whole with --ep-size). Every decode step's logprob
within 1e-4 of transformers' (fp32), greedy tokens equal; and the resolver's checks of the
sizes instead of a blanket refusal."""

from __future__ import annotations

from pathlib import Path

import pytest
from hf_compare import TOL, hf_logprobs
from model_fixtures import write_tokenizer
from test_deepseek_models import tiny_hf_model

import core
from core.engine.worker import make_plan
from core.plan.args import make_server_args
from core.plan.plan import ResolveError

FIXTURES = Path(__file__).parent / "fixtures" / "configs"
PROMPT = [256, 72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100, 33, 7, 9, 41]
N = 10


def _write(hf, path: Path) -> Path:
    hf.save_pretrained(str(path), safe_serialization=True)
    write_tokenizer(path)
    return path


def _check_tp2(kind: str, tmp_path: Path, **kw) -> None:
    hf = tiny_hf_model(kind)
    path = _write(hf, tmp_path / kind)
    with core.Engine(str(path), dtype="float32", max_total_tokens=512, tp_size=2,
                     device="cpu", **kw) as eng:
        out = eng.generate(input_ids=PROMPT, sampling_params={
            "max_new_tokens": N, "temperature": 0, "ignore_eos": True, "logprobs": True})
        notes = eng.client.info.notes
    assert any("tensor parallel: rank 0 of 2 (gloo), 2 of 4 heads and the whole MLA latent "
               "cache (replicated) per rank" in n for n in notes), notes
    ids = PROMPT + out["output_ids"]
    ref = hf_logprobs(hf, ids)
    got = out["meta_info"]["output_token_logprobs"]
    assert len(got) == len(out["output_ids"]) == N
    for step, ((lp, tok), out_tok) in enumerate(zip(got, out["output_ids"], strict=True)):
        row = ref[len(PROMPT) - 1 + step]
        assert tok == out_tok == int(row.argmax()), ("greedy token", step)
        assert abs(lp - row[tok].item()) < TOL, ("decode", step, lp, row[tok].item())


def test_v2_lite_tp2_matches_hf(tmp_path):
    """q_proj (no q_lora_rank), a dense first layer, 2 shared experts, experts split by their
    intermediate rows."""
    _check_tp2("v2_lite", tmp_path)


def test_v3_tp2_expert_parallel_matches_hf(tmp_path):
    """q_a / q_b, noaux_tc routing with its correction bias, experts placed whole (EP)."""
    _check_tp2("v3", tmp_path, ep_size=2)


@pytest.mark.slow  # another two-rank engine start; the EP one above covers V3 in CI
def test_v3_tp2_split_experts_matches_hf(tmp_path):
    _check_tp2("v3", tmp_path)


def test_resolver_checks_mla_sizes_instead_of_refusing(tmp_path):
    cfg = str(FIXTURES / "deepseek-v2-lite.json")
    _, plan, _, _ = make_plan(make_server_args(model_path=cfg, tp_size=2, device="cpu"))
    assert "mla" in plan.decode_attention
    assert any("tensor parallel over 2 ranks: 8 heads per rank; the MLA latent cache "
               "replicated on every rank" in n for n in plan.notes), plan.notes
    with pytest.raises(ResolveError) as info:
        make_plan(make_server_args(model_path=cfg, tp_size=3, device="cpu"))
    text = str(info.value)
    assert "DeepseekV2ForCausalLM does not split over --tp-size 3" in text
    assert "16 attention heads do not split over 3 ranks" in text
    assert "that split its 16 heads and MLP widths: 1, 2, 4, 8" in text, text
    assert "KV heads" not in text and "not split over ranks here" not in text
