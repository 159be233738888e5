"""The triton MoE runner's pieces, on a CPU under the Triton interpreter (or on a GPU): the
expert alignment (PyTorch and one-launch paths), the fused top-k routing, the tiling table, and
a tiny Qwen3-MoE through the runner against torch_native. (Its numerics over the whole case
matrix are the conformance suite's, tests/test_moe_conformance.py.)"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

if not torch.cuda.is_available():  # before the runner's kernels are imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

from test_moe_resolver import QWEN3_30B_A3B  # noqa: E402

from core.contract.moe import select_experts  # noqa: E402
from core.plan.registry import get_registry  # noqa: E402

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET", "") in ("", "0") and not torch.cuda.is_available(),
    reason="needs a GPU or TRITON_INTERPRET=1")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="module")
def registry():
    return get_registry()


def test_align_by_expert():
    from plugins.moe.triton.runner import align_by_expert

    ids = torch.tensor([[3, 0], [3, 1], [3, 0]])  # rows 0..5; expert 2 gets none
    sorted_ids, block_expert, total = align_by_expert(ids, 4, 4)
    assert int(total) == 12  # experts 0, 1, 3: one block of 4 each
    n = ids.numel()
    assert sorted_ids[:4].tolist() == [1, 5, n, n]  # expert 0: rows 1 and 5, then padding
    assert sorted_ids[4:8].tolist() == [3, n, n, n]
    assert sorted_ids[8:12].tolist() == [0, 2, 4, n]
    assert block_expert[:3].tolist() == [0, 1, 3]
    assert (sorted_ids[12:] == n).all()  # the worst case's tail: idle blocks


def test_tuning_table_picks_by_rows_per_expert():
    from plugins.moe.triton.tuning import TABLE, pick

    assert pick("sm90", 0.5) == TABLE["sm90"][0][1]  # decode: short tiles
    assert pick("sm90", 10_000) == TABLE["sm90"][-1][1]
    assert pick("unknown-arch", 1) == TABLE["sm80"][0][1]
    for entries in TABLE.values():
        assert entries[-1][0] is None  # every arch has a catch-all


@pytest.mark.skipif(DEVICE != "cpu", reason="the CPU harness")
def test_tiny_qwen3_moe_through_triton_matches_torch_native(tmp_path, registry):
    """The whole model with the triton runner (interpreter on a CPU) against torch_native."""
    from model_fixtures import PagedHarness, cpu_plan, torch_native_backend, write_config_model

    from core.engine.loader import load_model
    from core.plan.args import make_server_args

    config = dict(QWEN3_30B_A3B, hidden_size=64, intermediate_size=96, head_dim=16,
                  moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, num_experts=16, num_experts_per_tok=4,
                  vocab_size=260, max_position_embeddings=128, torch_dtype="float32")
    path = write_config_model(tmp_path / "m", config)
    args = make_server_args(model_path=path, load_format="dummy")
    plan = cpu_plan("qwen3_moe", page_size=4)
    logits = {}
    for runner in ("torch_native", "triton"):
        model = load_model(args, dataclasses.replace(plan, moe_runner=runner), registry)
        cfg = model.hf_config
        h = PagedHarness(cfg.num_hidden_layers, cfg.num_key_value_heads, 16, 4,
                         backend=torch_native_backend(cfg, page_size=4))
        with torch.inference_mode():
            out = []
            b = h.batch([0], [[5, 17, 99, 3, 250]])
            out.append(model.model.compute_logits(model.model(b.input_ids, b.positions, b)))
            for t in (7, 8):
                b = h.batch([0], [[t]], decode=True)
                out.append(model.model.compute_logits(model.model(b.input_ids, b.positions, b)))
        logits[runner] = torch.cat(out)
    torch.testing.assert_close(logits["triton"], logits["torch_native"], rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(DEVICE != "cpu", reason="the CPU harness")
@pytest.mark.parametrize("groups", [(4, 2), (1, 1)], ids=["v3-groups", "one-group"])
def test_tiny_deepseek_v3_through_triton_matches_hf(tmp_path, groups):
    """The tiny V3 of tests/test_deepseek_models.py (noaux_tc with a non-zero correction bias,
    routed_scaling_factor 2.5) served by the engine with the triton MoE runner (interpreter):
    every prompt and decode log-probability within 1e-4 of transformers'. Groups (4, 2): the
    grouped path; one group (Kimi-K2 / Moonlight): the bias in the routing kernels."""
    from hf_compare import check, greedy, run
    from model_fixtures import write_tokenizer
    from test_deepseek_models import PROMPTS, tiny_hf_model

    from core.engine.worker import build_engine_core, make_plan
    from core.plan.args import make_server_args

    hf = tiny_hf_model("v3")
    hf.config.n_group, hf.config.topk_group = groups
    hf = type(hf)(hf.config).float().eval()
    hf.load_state_dict(tiny_hf_model("v3").state_dict())
    hf.save_pretrained(str(tmp_path), safe_serialization=True)
    write_tokenizer(tmp_path)
    args, plan, spec, registry = make_plan(make_server_args(
        model_path=str(tmp_path), dtype="float32", max_total_tokens=512))
    assert spec.moe.correction_bias
    core = build_engine_core(args, dataclasses.replace(plan, moe_runner="triton"), spec,
                             registry)
    done = run(core.scheduler, [(f"p{i}", p, greedy(4, prompt_k=2))
                                for i, p in enumerate(PROMPTS)])
    for i, p in enumerate(PROMPTS):
        check(done[f"p{i}"], p, hf, prompt_logprobs=True)


@pytest.mark.parametrize("T,E,k,scoring,renorm,block_m", [
    (1, 8, 2, "softmax", True, 16), (3, 128, 8, "sigmoid", True, 16),
    (5, 60, 6, "softmax", False, 16), (16, 64, 8, "softmax", True, 16),
    (7, 128, 3, "sigmoid", False, 4), (1, 4, 4, "softmax", True, 16)])
def test_fused_routing_matches_torch(T, E, k, scoring, renorm, block_m):
    """One-launch top-k and alignment give exactly what select_experts and the PyTorch
    alignment give (same experts, same order, same padding)."""
    from plugins.moe.triton import routing
    from plugins.moe.triton.routing import fused_align, fused_topk
    from plugins.moe.triton.runner import align_by_expert

    logits = torch.randn(T, E, generator=torch.Generator().manual_seed(T * E + k)).to(DEVICE)
    weights, ids = fused_topk(logits, k, renorm, scoring)
    ref_w, ref_ids = select_experts(logits, k, renorm, None, scoring)
    assert torch.equal(ids.long(), ref_ids)
    torch.testing.assert_close(weights, ref_w)
    want_align = align_by_expert(ref_ids, E, block_m)
    for got, want in zip(fused_align(ids, E, block_m), want_align, strict=True):
        assert torch.equal(got.long(), want.long())
    # decode-sized steps: routing and alignment in one launch, the same outputs
    assert routing.can_route_align(T, E, k)
    rw, rids, *aligned = routing.route_and_align(logits, k, renorm, scoring, 1.0, block_m)
    assert torch.equal(rids.long(), ref_ids)
    torch.testing.assert_close(rw, ref_w)
    for got, want in zip(aligned, want_align, strict=True):
        assert torch.equal(got.long(), want.long())


@pytest.mark.parametrize("T,E,k,scoring,renorm", [
    (1, 16, 4, "sigmoid", True), (5, 64, 8, "sigmoid", True), (9, 128, 8, "sigmoid", False),
    (3, 60, 6, "softmax", True)])
def test_fused_routing_with_a_correction_bias_is_select_experts(T, E, k, scoring, renorm):
    """noaux_tc without groups (Kimi-K2 / Moonlight's one group) in the routing kernels: the
    experts chosen on scores + bias, weighted by the unbiased scores, scaled; exactly what
    select_experts gives, and not what it gives without the bias."""
    from plugins.moe.triton import routing

    g = torch.Generator().manual_seed(T * E + k)
    logits = torch.randn(T, E, generator=g).to(DEVICE)
    bias = (torch.randn(E, generator=g) * 0.3).to(DEVICE)
    ref_w, ref_ids = select_experts(logits, k, renorm, None, scoring, 2.5, bias)
    plain_ids = select_experts(logits, k, renorm, None, scoring, 2.5)[1]
    assert not torch.equal(plain_ids, ref_ids)  # the bias moves the choice here
    w, ids = routing.fused_topk(logits, k, renorm, scoring, 2.5, bias)
    assert torch.equal(ids.long(), ref_ids)
    torch.testing.assert_close(w, ref_w)
    assert routing.can_route_align(T, E, k)
    rw, rids, *_ = routing.route_and_align(logits, k, renorm, scoring, 2.5, 16, bias)
    assert torch.equal(rids.long(), ref_ids)
    torch.testing.assert_close(rw, ref_w)


@pytest.mark.parametrize("T,E,k,groups,scoring,renorm,biased", [
    (1, 256, 8, (8, 4), "sigmoid", True, True),  # DeepSeek-V3's decode step
    (16, 256, 8, (8, 4), "sigmoid", True, True), (3, 64, 4, (4, 1), "sigmoid", False, True),
    (6, 64, 8, (8, 4), "softmax", True, False),  # V2's group_limited_greedy: groups by best
    (5, 60, 6, (6, 2), "sigmoid", False, False), (7, 32, 2, (16, 3), "softmax", True, True)])
def test_grouped_routing_in_one_launch_is_select_experts(T, E, k, groups, scoring, renorm,
                                                         biased):
    """Decode-sized grouped top-k (with a correction bias: noaux_tc's top-2-sum groups) in
    route_align_kernel: exactly select_experts' experts, weights and alignment; the groups
    (and the bias) move the choice here, so a kernel skipping either would differ."""
    from plugins.moe.triton import routing
    from plugins.moe.triton.runner import align_by_expert

    g = torch.Generator().manual_seed(T * E + k)
    logits = torch.randn(T, E, generator=g).to(DEVICE)
    bias = (torch.randn(E, generator=g) * 0.3).to(DEVICE) if biased else None
    ref_w, ref_ids = select_experts(logits, k, renorm, groups, scoring, 2.5, bias)
    assert not torch.equal(select_experts(logits, k, renorm, None, scoring, 2.5, bias)[1],
                           ref_ids)
    assert routing.can_route_align(T, E, k, groups)
    w, ids, *aligned = routing.route_and_align(logits, k, renorm, scoring, 2.5, 16, bias,
                                               groups)
    assert torch.equal(ids.long(), ref_ids)
    torch.testing.assert_close(w, ref_w)
    for got, want in zip(aligned, align_by_expert(ref_ids, E, 16), strict=True):
        assert torch.equal(got.long(), want.long())
    # where the kept groups hold fewer than k experts, or too many tokens: PyTorch's path
    assert not routing.can_route_align(T, E, E // groups[0] * groups[1] + 1, groups)
    assert not routing.can_route_align(routing.MAX_ROUTE_TOKENS + 1, E, k, groups)


def test_route_and_align_scales_and_takes_strided_logits():
    from plugins.moe.triton import routing

    logits = torch.randn(4, 40, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    wide = torch.cat([logits, logits], 1)[:, :40]  # rows strided by 80
    w, ids, *_ = routing.route_and_align(wide, 4, False, "softmax", 2.5, 16)
    ref_w, ref_ids = select_experts(logits, 4, False, None, "softmax", 2.5)
    assert torch.equal(ids.long(), ref_ids)
    torch.testing.assert_close(w, ref_w)
    assert not routing.can_route_align(routing.MAX_ROUTE_TOKENS + 1, 128, 1)
    assert not routing.can_route_align(16, 128, 9)  # 144 rows: over MAX_ALIGN_ROWS


def test_fp32_tilings_fit_shared_memory():
    """The tables are for 16-bit types; fp32 gets fewer stages / a shorter block_k so that the
    gate/up kernel's pipelined tiles fit (an fp32 decode tile asked the H200 for 272 KiB)."""
    from plugins.moe.triton import tuning

    for arch in ("sm90", "sm80"):
        limit = tuning.SMEM_BYTES[arch]
        for _, tiling in tuning.TABLE[arch]:
            bm, bn, bk, _, stages = tuning.fit_dtype(tiling, 4, arch)
            assert (bm + 2 * bn) * bk * 4 * stages <= limit, (arch, tiling)
            assert stages >= 1 and bk >= 16
            assert tuning.fit_dtype(tiling, 2, arch)[:3] == tiling[:3]  # 16-bit: as tabled
    assert tuning.fit_dtype((16, 128, 128, 4, 3), 4, "sm90") != (16, 128, 128, 4, 3)
    assert tuning.fit_dtype((16, 32, 32, 1, 1), 4, "interpreter") == (16, 32, 32, 1, 1)


@pytest.mark.parametrize("activation,biased", [("silu", False), ("swigluoai", True)])
def test_block_fp8_experts_match_the_block_reference(activation, biased):
    """Form "fp8" with block scales through both kernels: under the interpreter fp16 stands in
    for e4m3 (the kernel quantizes each activation tile to the weights' dtype), so the
    reference rounds to fp16 the same way; on a GPU the operands are e4m3. With GPT-OSS's
    swigluoai (limit 1: many values clamped) and expert biases (a GPT-OSS fp8_block
    checkpoint's experts) too."""
    from core.contract.moe import MoELayerParams, MoEWeights
    from plugins.moe.triton.runner import TritonMoE

    torch.manual_seed(0)
    gpu = torch.cuda.is_available()
    dev = "cuda" if gpu else "cpu"
    q_ty = torch.float8_e4m3fn if gpu else torch.float16
    E, H, inter, top_k, T, bn, bk = 4, 64, 64, 2, 9, 32, 32
    w13 = (torch.randn(E, 2 * inter, H) * 0.2).to(q_ty).to(dev)
    w2 = (torch.randn(E, H, inter) * 0.2).to(q_ty).to(dev)
    s13 = (torch.rand(E, 2 * inter // bn, H // bk) + 0.5).to(dev)
    s2 = (torch.rand(E, H // bn, inter // bk) + 0.5).to(dev)
    extra = {"w13_scale": s13, "w2_scale": s2, "block": torch.tensor([bn, bk])}
    bias_gen = torch.Generator().manual_seed(1)
    b13 = torch.randn(E, 2 * inter, generator=bias_gen) * 0.5
    b2 = torch.randn(E, H, generator=bias_gen) * 0.5
    if biased:
        extra |= {"w13_bias": b13.to(dev), "w2_bias": b2.to(dev)}
    weights = MoEWeights(w13, w2, form="fp8", extra=extra)
    layer = MoELayerParams(layer_id=0, num_experts=E, top_k=top_k, hidden_size=H,
                           intermediate_size=inter, renormalize=True, activation=activation,
                           swiglu_limit=1.0)
    x = torch.randn(T, H, dtype=torch.float16, device=dev)
    logits = torch.randn(T, E, device=dev)
    runner = TritonMoE(tiling=(16, 32, bk, 4, 1) if not gpu else None)
    y = runner.forward(x, logits, weights, layer)

    def fq(a):  # per row, per bk inputs: amax / 448, rounded to q_ty
        g = a.float().view(a.shape[0], -1, bk)
        s = g.abs().amax(-1, keepdim=True).clamp(min=1e-12) / 448.0
        return ((g / s).to(q_ty).float() * s).view(a.shape[0], -1)

    def real(w, s):
        return w.float() * s.repeat_interleave(bn, 1).repeat_interleave(bk, 2)

    W13, W2 = real(w13, s13).cpu(), real(w2, s2).cpu()
    probs = torch.softmax(logits.float().cpu(), -1)
    top_w, top_i = probs.topk(top_k, -1)
    top_w = top_w / top_w.sum(-1, keepdim=True)
    ref = torch.zeros(T, H)
    for t in range(T):
        for wt, e in zip(top_w[t].tolist(), top_i[t].tolist(), strict=True):
            gu = fq(x[t:t + 1].cpu()) @ W13[e].t()
            if biased:
                gu = gu + b13[e]
            g, u = gu.chunk(2, -1)
            if activation == "swigluoai":  # GPT-OSS's, written out
                g, u = g.clamp(max=1.0), u.clamp(-1.0, 1.0)
                h = ((u + 1) * g / (1 + torch.exp(-1.702 * g))).half()
            else:
                h = (torch.nn.functional.silu(g) * u).half()
            down = fq(h) @ W2[e].t()
            ref[t] += wt * ((down + b2[e]) if biased else down)[0]
    err = ((y.float().cpu() - ref).norm() / ref.norm()).item()
    assert err < (2e-2 if gpu else 2e-3), err


@pytest.mark.parametrize("with_shared", [False, True])
def test_decode_sum_in_the_down_kernel_equals_the_separate_sum(with_shared, monkeypatch):
    """Decode-sized steps sum each token's k rows (+ shared) in the down kernel's last programs;
    the result is bitwise the runner's separate sum, and the column counts are left at zero."""
    from core.contract.moe import MoELayerParams, MoEWeights
    from plugins.moe.triton import runner as triton_runner

    g = torch.Generator().manual_seed(5)
    T, E, k, H, inter = 3, 8, 2, 64, 32
    x = torch.randn(T, H, generator=g).half().to(DEVICE)
    logits = torch.randn(T, E, generator=g).to(DEVICE)
    w = MoEWeights((torch.randn(E, 2 * inter, H, generator=g) * H ** -0.5).half().to(DEVICE),
                   (torch.randn(E, H, inter, generator=g) * inter ** -0.5).half().to(DEVICE))
    layer = MoELayerParams(0, E, k, H, inter)
    shared = torch.randn(T, H, generator=g).half().to(DEVICE) if with_shared else None
    runner = triton_runner.TritonMoE()
    fused = runner.forward(x, logits, w, layer, shared)
    assert not triton_runner._LOCKS[x.device].any()
    monkeypatch.setattr(triton_runner, "FUSE_SUM_TOKENS", 0)
    assert torch.equal(fused, runner.forward(x, logits, w, layer, shared))
