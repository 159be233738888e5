"""DeepSeek-V3 block-FP8 checkpoints (quant_method fp8, weight_block_size [128, 128], e4m3
codes + `weight_scale_inv`) through the fp8 method, against transformers on the weights the file
means.

The checkpoint is written here as DeepSeek's own is: the MLA projections (q_a / q_b,
kv_a_proj_with_mqa, kv_b_proj, o_proj), the dense MLP, the shared and routed experts in e4m3
with a scale per 128x128 block (quantized by conformance.quant_refs.deepseek_fp8_block, an
independent reference of the format, partial blocks included); embeddings, LM head, norms,
the router gate and e_score_correction_bias stay dense (as in DeepSeek-V3's files). Sizes put
partial blocks where V3 has them (kv_a_proj_with_mqa's rows: 576 there, 160 here) and more
(q_b_proj's and o_proj's inputs, kv_b_proj's rows).

The reference: HF's DeepseekV3ForCausalLM in fp32 holding the dequantized weights, with every
input of a quantized product fake-quantized the way the fp8 method's dynamic activations are
(e4m3, one scale per 128 inputs of a token: conformance.quant_refs.fake_quant_acts), except
kv_b_proj's: the MLA layer holds it dequantized and the backend multiplies the latent by it
unquantized. What is left between the two is fp32 summation order, and that is not always
small here: an activation within an ulp of an e4m3 rounding boundary takes one code or the
next (a step of 1/16 of its value), and every later position attending to it moves by up to
~3e-2 (measured: HF against itself with its embeddings perturbed by 2e-7 relative moves by that
much on one prompt). So the reference is run a few times with such perturbations: at each
logprob, ours must lie within 1e-4 of the range those runs span (where a position is stable,
that is 1e-4 of HF's single value), and most positions must be stable, or the check is void.
A wrong scale, block layout or a skipped activation quantization is off by 1e-2 to 1e-1
everywhere (test_the_reference_is_not_trivial).
"""

from __future__ import annotations

import json

import pytest
import torch
from hf_compare import greedy, run
from model_fixtures import VOCAB, write_tokenizer

from conformance.quant_refs import deepseek_fp8_block, fake_quant_acts
from core.contract.quant import parse_quant_config
from core.engine.loader import load_model
from core.engine.worker import build_engine_core, make_plan
from core.plan.args import ServerArgs, make_server_args
from core.plan.checks import check_quant
from core.plan.devices import PROFILES
from core.plan.model_spec import load_model_spec
from core.plan.plan import ResolveError
from core.plan.registry import build_registry
from core.plan.resolver import explain, resolve

V3_FP8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
          "weight_block_size": [128, 128]}
TOL = 1e-4
NOISE = 2e-7  # relative, on the embeddings: fp32 summation-order-sized
PROMPTS = [[(5 * i + 11 * j) % 250 + 3 for j in range(n)] for i, n in enumerate((21, 9))]
# The modules DeepSeek-V3's checkpoint stores in e4m3 (per layer, HF names)
_FP8 = (".q_a_proj.", ".q_b_proj.", ".q_proj.", ".kv_a_proj_with_mqa.", ".kv_b_proj.",
        ".o_proj.", ".gate_proj.", ".up_proj.", ".down_proj.")


def tiny_v3():
    import transformers

    cfg = transformers.DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=256, intermediate_size=256, moe_intermediate_size=128,
        num_hidden_layers=2, first_k_dense_replace=1, num_attention_heads=4,
        num_key_value_heads=4, q_lora_rank=192, kv_lora_rank=128, qk_nope_head_dim=32,
        qk_rope_head_dim=32, v_head_dim=24, n_routed_experts=4, num_experts_per_tok=2,
        n_shared_experts=1, n_group=2, topk_group=1, routed_scaling_factor=2.5,
        norm_topk_prob=True, max_position_embeddings=256, rms_norm_eps=1e-6,
        tie_word_embeddings=False, bos_token_id=256, eos_token_id=258, pad_token_id=259,
        rope_interleave=True)
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(cfg).float().eval()
    if hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation("eager")  # one F.linear per expert (hooked below)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif p.dim() > 1:
                p.copy_(torch.randn_like(p) * 0.6 / p.shape[-1] ** 0.5)
            else:
                p.copy_(0.1 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.05 * torch.randn_like(b))
    return model


def _write(path, hf) -> dict[str, torch.Tensor]:
    """The FP8 checkpoint of `hf` at `path`; hf's quantized weights replaced by what the file
    means. Returns the file's tensors."""
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}

    def put(name: str, w: torch.Tensor) -> torch.Tensor:
        codes, scale, deq = deepseek_fp8_block(w)
        tensors[name] = codes
        tensors[name[:-len("weight")] + "weight_scale_inv"] = scale
        return deq

    inter = hf.config.moe_intermediate_size
    with torch.no_grad():
        for name, p in hf.state_dict().items():
            if name.endswith("mlp.experts.gate_up_proj"):  # [E, 2I, H] in memory: per expert
                base = name.rsplit(".", 1)[0]
                for e in range(p.shape[0]):
                    p[e, :inter] = put(f"{base}.{e}.gate_proj.weight", p[e, :inter])
                    p[e, inter:] = put(f"{base}.{e}.up_proj.weight", p[e, inter:])
            elif name.endswith("mlp.experts.down_proj"):
                base = name.rsplit(".", 1)[0]
                for e in range(p.shape[0]):
                    p[e] = put(f"{base}.{e}.down_proj.weight", p[e])
            elif name.endswith(".weight") and any(m in name for m in _FP8):
                p.copy_(put(name, p))
            else:
                tensors[name] = p.contiguous()
    save_file(tensors, str(path / "model.safetensors"))
    raw = hf.config.to_dict()
    raw["architectures"] = ["DeepseekV3ForCausalLM"]
    raw["quantization_config"] = V3_FP8
    (path / "config.json").write_text(json.dumps(raw))
    write_tokenizer(path)
    return tensors


class _FakeQuantActs(torch.overrides.TorchFunctionMode):
    """Every F.linear whose weight is not in `dense` gets its input fake-quantized per 128
    inputs of a token (e4m3), as the fp8 method's dynamic activations are."""

    def __init__(self, dense: set[int]):
        super().__init__()
        self.dense = dense

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.functional.linear:
            x, w = args[0], args[1]
            if w.data_ptr() not in self.dense:
                shape = x.shape
                x = fake_quant_acts(x.reshape(-1, shape[-1]), "fp8_group").reshape(shape).to(
                    x.dtype)
                args = (x, *args[1:])
        return func(*args, **kwargs)


def hf_w8a8_logprobs(hf, ids: list[int], quantize_acts: bool = True,
                     noise_seed: int | None = None) -> torch.Tensor:
    """[len(ids), V] log-softmax of HF on the dequantized weights, activations of the fp8
    products fake-quantized (not the router's, the LM head's, nor kv_b_proj's); with
    `noise_seed`, the embeddings times (1 + NOISE * N(0, 1)) first."""
    dense = {m.weight.data_ptr() for n, m in hf.named_modules()
             if n.endswith(("kv_b_proj", "mlp.gate", "lm_head"))}
    hook = None
    if noise_seed is not None:
        gen = torch.Generator().manual_seed(noise_seed)
        hook = hf.model.embed_tokens.register_forward_hook(
            lambda m, i, o: o * (1 + NOISE * torch.randn(o.shape, generator=gen)))
    try:
        with torch.no_grad():
            if quantize_acts:
                with _FakeQuantActs(dense):
                    logits = hf(torch.tensor([ids], device=hf.device)).logits[0]
            else:
                logits = hf(torch.tensor([ids], device=hf.device)).logits[0]
    finally:
        if hook is not None:
            hook.remove()
    return torch.log_softmax(logits.float(), -1).cpu()


def reference_range(hf, ids: list[int], runs: int = 4
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(low, high) [len(ids), V] over the reference and `runs` perturbed runs of it, and each
    run's greedy token [runs + 1, len(ids)]."""
    refs = torch.stack([hf_w8a8_logprobs(hf, ids)]
                       + [hf_w8a8_logprobs(hf, ids, noise_seed=s) for s in range(runs)])
    return refs.amin(0), refs.amax(0), refs.argmax(-1)


@pytest.fixture(scope="module")
def v3_fp8(tmp_path_factory):
    path = tmp_path_factory.mktemp("deepseek-v3-fp8")
    hf = tiny_v3()
    tensors = _write(path, hf)
    args, plan, _, registry = make_plan(make_server_args(model_path=str(path), dtype="float32"))
    return path, hf, tensors, plan, load_model(args, plan, registry)


def test_checkpoint_is_the_v3_layout(v3_fp8):
    """What was written is DeepSeek-V3's layout: e4m3 codes with ceil-sized block scales for
    the MLA projections and the experts, the router and norms dense."""
    _, _, tensors, _, _ = v3_fp8
    p = "model.layers.1."
    assert tensors[p + "self_attn.kv_a_proj_with_mqa.weight"].dtype == torch.float8_e4m3fn
    assert tuple(tensors[p + "self_attn.kv_a_proj_with_mqa.weight_scale_inv"].shape) == (2, 2)
    assert tuple(tensors[p + "self_attn.q_b_proj.weight_scale_inv"].shape) == (2, 2)  # 256x192
    assert tuple(tensors[p + "self_attn.kv_b_proj.weight_scale_inv"].shape) == (2, 1)  # 224x128
    assert tuple(tensors[p + "self_attn.o_proj.weight_scale_inv"].shape) == (2, 1)  # 256x96
    assert tensors[p + "mlp.experts.3.down_proj.weight"].dtype == torch.float8_e4m3fn
    assert tensors[p + "mlp.shared_experts.up_proj.weight"].dtype == torch.float8_e4m3fn
    assert tensors[p + "mlp.gate.weight"].dtype == torch.float32
    assert p + "mlp.gate.weight_scale_inv" not in tensors


def test_loads_through_fp8_with_kv_b_proj_dequantized(v3_fp8):
    _, hf, tensors, plan, loaded = v3_fp8
    assert (plan.quant_method, plan.quant_format) == ("fp8", "fp8_block")
    assert plan.prefill_attention == plan.decode_attention  # the CPU's MLA backend
    assert "mla" in plan.decode_attention
    attn = loaded.model.model.layers[1].self_attn
    assert attn.kv_a_proj_with_mqa.weight.dtype == torch.float8_e4m3fn
    assert attn.q_b_proj.weight_scale_inv.shape == (2, 2)
    kv_b = attn.attn.kv_b_proj.weight
    assert kv_b.dtype == torch.float32 and not hasattr(attn.attn.kv_b_proj, "weight_scale_inv")
    # exactly what the file means (the reference's dequantization, held by the HF model)
    want = hf.model.layers[1].self_attn.kv_b_proj.weight
    assert torch.equal(kv_b, want)
    assert any("kv_b_proj dequantized at load" in n for n in loaded.notes), loaded.notes
    moe = loaded.model.model.layers[1].mlp
    assert moe.weights().form == "fp8" and moe.weights().w13.dtype == torch.float8_e4m3fn


def test_prefill_and_decode_match_hf_on_the_dequantized_weights(v3_fp8):
    path, hf, _, _, loaded = v3_fp8
    args, plan, spec, registry = make_plan(make_server_args(
        model_path=str(path), dtype="float32", max_total_tokens=512))
    core = build_engine_core(args, plan, spec, registry, loaded)
    done = run(core.scheduler, [(f"p{i}", p, greedy(5, prompt_k=1))
                                for i, p in enumerate(PROMPTS)])
    outside, stable, total = [], 0, 0

    def within(lp: float, lo: torch.Tensor, hi: torch.Tensor, where: tuple) -> None:
        nonlocal stable, total
        total += 1
        stable += int((hi - lo).item() <= TOL)
        if not lo.item() - TOL <= lp <= hi.item() + TOL:
            outside.append((where, lp, lo.item(), hi.item()))

    for i, prompt in enumerate(PROMPTS):
        req = done[f"p{i}"]
        ids = prompt + list(req.output_ids)
        lo, hi, tops = reference_range(hf, ids)
        assert len(req.prompt_lps) == len(prompt) - 1
        for j, (lp, _, _) in enumerate(req.prompt_lps):
            within(lp, lo[j, prompt[j + 1]], hi[j, prompt[j + 1]], ("prompt", i, j))
        lps = req.pending_lps if req.pending_lps else req.output_lps
        assert len(lps) == len(req.output_ids) == 5
        for step, (tok, lp) in enumerate(zip(req.output_ids, lps, strict=True)):
            row = len(prompt) - 1 + step
            assert tok in tops[:, row].tolist(), ("greedy token", i, step)
            within(lp[0], lo[row, tok], hi[row, tok], ("decode", i, step))
    assert not outside, outside
    assert stable >= 0.75 * total, (stable, total)
    core.scheduler.check_accounting()


def test_the_reference_is_not_trivial(v3_fp8):
    """The activation quantization the reference models moves the logprobs well past TOL (so
    matching within TOL says the engine quantizes as the format says, not that it does not
    matter)."""
    _, hf, _, _, _ = v3_fp8
    ids = PROMPTS[0]
    gap = (hf_w8a8_logprobs(hf, ids) - hf_w8a8_logprobs(hf, ids, quantize_acts=False)).abs()
    assert gap.max().item() > 10 * TOL, gap.max().item()


def test_resolve_plans_fp8_and_an_mla_backend(v3_fp8):
    """`core resolve` on the V3-FP8 config: fp8 (fp8_block) with an MLA backend on an H200 and
    on the CPU; a method that cannot give kv_b_proj back dense is refused for it, saying so."""
    from dataclasses import replace

    path = v3_fp8[0]
    spec = load_model_spec(str(path))
    assert spec.attention_kind == "MLA" and spec.quant_method == "fp8"
    registry = build_registry()
    for profile in ("h200", "x86-cpu"):
        plan = resolve(spec, PROFILES[profile], ServerArgs(), registry)
        assert (plan.quant_method, plan.quant_format) == ("fp8", "fp8_block"), profile
        assert "mla" in plan.decode_attention and "mla" in plan.prefill_attention, profile
        assert "fp8 (fp8_block)" in explain(plan)
    fp8 = registry.get("quant", "fp8").caps
    assert fp8.dense_weights
    reasons = check_quant(replace(fp8, dense_weights=False), spec, PROFILES["h200"],
                          dtype="bfloat16", requested=None, scheme=parse_quant_config(V3_FP8))
    assert any("kv_b_proj" in r for r in reasons), reasons



def test_blocks_that_cannot_hold_stacked_gate_and_up_are_refused(v3_fp8, tmp_path):
    """A partial block is fine at the end of a projection (kv_a_proj_with_mqa above), not
    between gate and up where one tensor stacks them: a dense MLP 192 wide would put up's
    first rows in gate's last block. The resolver says so (the loader would fail on
    up_proj.weight_scale_inv's rows)."""
    raw = json.loads((v3_fp8[0] / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**raw, "intermediate_size": 192}))
    spec = load_model_spec(str(tmp_path))
    with pytest.raises(ResolveError) as info:
        resolve(spec, PROFILES["h200"], ServerArgs(), build_registry())
    assert "fp8: intermediate_size 192 is not a multiple of the 128-row weight blocks" \
        in str(info.value), str(info.value)


def test_online_fp8_keeps_kv_b_proj_as_the_checkpoint_has_it(tmp_path):
    """--quantization fp8 of a dense MLA checkpoint quantizes the projections at load but not
    kv_b_proj, which the MLA layer holds dense anyway: it stays bit for bit the file's."""
    from test_deepseek_models import tiny_hf_model

    hf = tiny_hf_model("v2_lite")
    hf.save_pretrained(str(tmp_path), safe_serialization=True)
    write_tokenizer(tmp_path)
    args, plan, _, registry = make_plan(make_server_args(model_path=str(tmp_path),
                                                         dtype="float32", quantization="fp8"))
    assert (plan.quant_method, plan.quant_format) == ("fp8", "fp8_channel")
    loaded = load_model(args, plan, registry)
    attn = loaded.model.model.layers[1].self_attn
    assert attn.q_proj.weight.dtype == torch.float8_e4m3fn
    assert torch.equal(attn.attn.kv_b_proj.weight, hf.model.layers[1].self_attn.kv_b_proj.weight)
    assert not any("kv_b_proj dequantized" in n for n in loaded.notes)

# ---- on a GPU (run with `pytest -m gpu tests/test_deepseek_fp8.py` on an sm89+ NVIDIA GPU) ----

def _fp8_gpu() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(576, 7168), (1536, 7168), (7168, 2048)],
                         ids=["kv_a_proj_with_mqa", "q_a_proj", "expert_down"])
@pytest.mark.parametrize("m", [1, 5, 64])
def test_gpu_fp8_linear_on_v3_shapes(n, k, m):
    """The fp8 method's CUDA kernels (one fused launch for M <= 16, the block-scaled GEMM
    above) on DeepSeek-V3's projection shapes, 576 rows included (4.5 blocks), against the
    fp32 product of the reference's dequantized weight and fake-quantized x. The codes are
    the same bits (core.contract.quant), so what is left is fp32 accumulation order and the
    bf16 output's rounding (2^-9 relative): 1e-2 of the output's norm."""
    if not _fp8_gpu():
        pytest.skip("needs a CUDA device with fp8 (sm89+)")
    from core.layers import Linear, ModelContext, process_weights_after_loading
    from plugins.quant.fp8.method import Fp8LinearMethod

    torch.manual_seed(0)
    w = torch.randn(n, k) * 0.02
    codes, scale, deq = deepseek_fp8_block(w)
    ctx = ModelContext(dtype=torch.bfloat16, device=torch.device("cuda"),
                       quant_method=Fp8LinearMethod(parse_quant_config(V3_FP8)))
    layer = Linear(k, n, False, ctx)
    assert tuple(layer.weight_scale_inv.shape) == tuple(scale.shape)
    with torch.no_grad():
        layer.weight_loader(layer.weight, codes.cuda())
        layer.weight_loader(layer.weight_scale_inv, scale.cuda())
    model = torch.nn.Sequential(layer)
    process_weights_after_loading(model)
    assert layer.fp8_kernel == "triton"
    assert torch.equal(layer.quant_method.dense_weight(layer).cpu(), deq)
    x = torch.randn(m, k, dtype=torch.bfloat16)
    ref = fake_quant_acts(x.float(), "fp8_group") @ deq.t()
    got = layer(x.cuda()).float().cpu()
    err = ((got - ref).norm() / ref.norm()).item()
    assert err < 1e-2, err


@pytest.mark.gpu
def test_gpu_v3_fp8_engine_matches_the_reference(v3_fp8):
    """The tiny V3-FP8 checkpoint served on the GPU in bf16 (the plan's MLA backend and the
    MoE runner it picks for fp8_block experts there), end to end: a coarse check that the
    whole path serves. bf16 activations between the fp8 products flip e4m3 codes here and
    there, and this tiny model's weights (larger than HF's init) amplify it: on an H100 the
    prompt logprobs were 0.29 from HF's fp32 W8A8 reference at worst. So the bar is HF's own
    bf16 run of the same reference on the GPU: ours may be at most twice as far from the fp32
    reference as it is (and always within 0.05). The exact checks of the kernels are
    test_gpu_fp8_linear_on_v3_shapes and the CPU tests above."""
    import copy

    if not _fp8_gpu():
        pytest.skip("needs a CUDA device with fp8 (sm89+)")
    path, hf, _, _, _ = v3_fp8
    args, plan, spec, registry = make_plan(make_server_args(
        model_path=str(path), dtype="bfloat16", max_total_tokens=512))
    assert plan.device.device_type == "cuda"
    assert (plan.quant_method, plan.quant_format) == ("fp8", "fp8_block")
    core = build_engine_core(args, plan, spec, registry)
    done = run(core.scheduler, [(f"p{i}", p, greedy(4, prompt_k=1))
                                for i, p in enumerate(PROMPTS)])
    hf_bf16 = copy.deepcopy(hf).to(device="cuda", dtype=torch.bfloat16)
    worst = peer = 0.0
    for i, prompt in enumerate(PROMPTS):
        ref, theirs = hf_w8a8_logprobs(hf, prompt), hf_w8a8_logprobs(hf_bf16, prompt)
        for j, (lp, _, _) in enumerate(done[f"p{i}"].prompt_lps):
            worst = max(worst, abs(lp - ref[j, prompt[j + 1]].item()))
            peer = max(peer, abs(theirs[j, prompt[j + 1]].item() - ref[j, prompt[j + 1]].item()))
    assert worst < max(0.05, 2 * peer), (worst, peer)
    core.scheduler.check_accounting()
