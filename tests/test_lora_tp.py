"""LoRA under tensor parallelism (issue 36: "works with TP: A and B sharded like their base
layers"): every rank keeps its part of each adapter, split like the base layer (column-parallel
q/k/v and gate/up: B's rows; row-parallel o and down: A's columns, the partial delta summed by
the layer's all-reduce). Checked without processes on each rank's part (both backends, GQA's
split KV heads and their replicas at tp 4) and end to end at --tp-size 2 on the CPU (gloo)
against HF transformers + PEFT (fp32), a mixed batch of base and adapter requests, and an
adapter loaded while serving."""

from __future__ import annotations

import os

import pytest
import torch

# peft imports triton: the interpreter is chosen before it is (as test_lora.py does)
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("peft")

from model_fixtures import (  # noqa: E402
    LORA_ALL,
    greedy_reference,
    peft_reference,
    tiny_config,
    write_peft_adapter,
    write_tiny_model,
)

import core  # noqa: E402
from core.contract.capabilities import LoRACaps  # noqa: E402
from core.contract.lora import LoRAConfig  # noqa: E402
from core.engine.distributed import TPGroup  # noqa: E402
from core.engine.lora import LoRAManager  # noqa: E402
from core.layers import ModelContext  # noqa: E402
from core.plan.checks import check_lora  # noqa: E402
from core.plan.devices import load_profile  # noqa: E402

PROMPTS = [[256, 72, 101, 108, 108, 111], [256, 10, 20, 30, 40, 50, 60, 70, 80, 90],
           [256, 5, 4, 3]]
N_NEW = 8
SUBSET = ("k_proj", "v_proj", "o_proj", "up_proj")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The tiny Llama (4 heads, 2 KV heads: GQA, KV heads split at tp 2) and three adapters:
    rank 8 and rank 16 (rslora) on every projection, rank 4 on a subset."""
    root = tmp_path_factory.mktemp("lora-tp")
    return write_tiny_model("llama", root / "model"), {
        "a": write_peft_adapter("llama", root / "a", r=8, alpha=16, seed=1),
        "b": write_peft_adapter("llama", root / "b", r=16, alpha=8, use_rslora=True, seed=2),
        "c": write_peft_adapter("llama", root / "c", r=4, alpha=8, seed=3,
                                target_modules=SUBSET),
        "big": write_peft_adapter("llama", root / "big", r=32, alpha=8, seed=4)}


# -- each rank's part, no processes ---------------------------------------------------------------


def _rank_manager(cfg, tp: TPGroup, backend):
    from core.layers.linear import Linear
    from plugins.models.llama import LlamaForCausalLM

    torch.manual_seed(0)  # the same base weights for every rank (each keeps its part of them)
    full = LlamaForCausalLM(cfg, ModelContext())
    model = LlamaForCausalLM(cfg, ModelContext(tp=tp))
    for whole, part in zip(full.modules(), model.modules(), strict=True):
        if isinstance(part, Linear):  # the checkpoint's tensor, cut by the layer's loader
            torch.nn.init.normal_(whole.weight, std=0.1)
            part.weight_loader(part.weight, whole.weight.data)
    return model, LoRAManager(model, backend, 2, 16, set(LORA_ALL), torch.float32,
                              torch.device("cpu"))


def _backend(name: str):
    config = LoRAConfig(num_slots=2, max_rank=16, dtype=torch.float32,
                        device=torch.device("cpu"))
    if name == "triton":
        pytest.importorskip("triton")
        from plugins.lora.triton.backend import TritonLoRA

        return TritonLoRA(config)
    from plugins.lora.torch_native.backend import TorchNativeLoRA

    return TorchNativeLoRA(config)


def _projection_outputs(model, manager, x_in: dict[str, torch.Tensor]):
    """Every adapted linear's output on its input for this rank (the partial sum, before the
    all-reduce, for a row-parallel one), tokens 0-4 base, 5-9 slot 0, 10-14 slot 1."""
    manager.begin_step([5, 5, 5], [-1, 0, 1])
    outs = {}
    for name, linear in model.named_modules():
        if getattr(linear, "epilogue", None) is None:
            continue
        x = x_in[name]
        x = linear.rank_inputs(x).contiguous()
        outs[name] = linear.epilogue(x, linear.quant_method.apply(linear, x))
    return outs


@pytest.mark.parametrize("backend", ["torch_native",
                                     pytest.param("triton", marks=pytest.mark.slow)])
@pytest.mark.parametrize("tp_size,kv_heads", [(2, 2), (4, 2)])
def test_rank_parts_sum_to_the_unsplit_projection(files, backend, tp_size, kv_heads):
    """On every adapted projection, each rank's output (its rows of a column-parallel one; the
    ranks' partial sums of a row-parallel one) equals the unsplit layer's, adapters included:
    at tp 2 the KV heads split (GQA, 2 KV heads), at tp 4 they are replicated (2 ranks per
    head)."""
    _, adapters = files
    cfg = tiny_config("llama", num_key_value_heads=kv_heads)
    torch.manual_seed(1)
    x_in = {}
    one, m1 = _rank_manager(cfg, TPGroup(rank=0, size=1), _backend(backend))
    for n in ("a", "b"):
        m1.load(n, str(adapters[n]))
        m1.acquire(m1.lookup(n))
    for name, linear in one.named_modules():
        if getattr(linear, "epilogue", None) is not None:
            x_in[name] = torch.randn(15, linear.input_size)
    want = _projection_outputs(one, m1, x_in)
    got: dict[str, list[torch.Tensor]] = {}
    parts = {}
    for rank in range(tp_size):
        tp = TPGroup(rank=rank, size=tp_size)
        model, m = _rank_manager(cfg, tp, _backend(backend))
        for n in ("a", "b"):
            m.load(n, str(adapters[n]))
            m.acquire(m.lookup(n))
        parts[rank] = dict(model.named_modules())
        for name, y in _projection_outputs(model, m, x_in).items():
            got.setdefault(name, []).append(y)
    for name, ys in got.items():
        linear = parts[0][name]
        if linear.parallel == "row":  # partial sums: the all-reduce adds them
            y = torch.stack(ys).sum(0)
        else:  # each rank's rows of every fused part (q, k, v / gate, up)
            y = _gather_rows(ys, [parts[r][name] for r in range(tp_size)])
        torch.testing.assert_close(y, want[name], rtol=1e-5, atol=1e-5, msg=name)
        base = one.get_submodule(name).quant_method.apply(one.get_submodule(name), x_in[name])
        assert (want[name][5:] - base[5:]).abs().max() > 1e-3, name  # the adapters add
        torch.testing.assert_close(want[name][:5], base[:5], msg=name)  # base tokens: none


def _gather_rows(ys, linears):
    """The unsplit column-parallel output from the ranks' parts: each fused part's rows in
    rank order, a replicated KV head taken once (from the first rank holding it)."""
    n_parts = len(linears[0].output_sizes)
    cols = []
    for j in range(n_parts):
        seen = set()
        for y, lin in zip(ys, linears, strict=True):
            start, _ = lin._rows[j]
            if start in seen:
                continue  # a replica of a KV head an earlier rank holds
            seen.add(start)
            sl = lin.shard_slice(lin.shard_names[j] if lin.shard_names else None)
            cols.append(y[:, sl])
    return torch.cat(cols, dim=1)


def test_a_backend_without_tensor_parallel_is_still_refused():
    device = load_profile("h100")
    caps = LoRACaps(devices=("cuda", "cpu"), tensor_parallel=False)
    assert any("does not shard adapters over tensor-parallel ranks" in r
               for r in check_lora(caps, device, dtype="float16", quant_method="unquantized",
                                   max_rank=16, tp_size=2))
    assert check_lora(caps, device, dtype="float16", quant_method="unquantized", max_rank=16,
                      tp_size=1) == []


# -- end to end at --tp-size 2 (gloo) -------------------------------------------------------------


def test_tp2_mixed_batch_matches_hf_peft_and_loads_at_runtime(files):
    """--tp-size 2 on the CPU: base, rank-8, rank-16 and subset-adapter requests in one batch
    give HF+PEFT's greedy tokens with logprobs within 1e-4 (test_lora.py's bound); an adapter
    loaded while serving is split and served the same."""
    model, adapters = files
    want = {}
    for name in ("a", "b", "c", None):
        ref = peft_reference("llama", adapters[name] if name else None)
        want[name] = [greedy_reference(ref, p, N_NEW) for p in PROMPTS]
    assert len({tuple(want[n][0][0]) for n in want}) == 4  # the adapters change the output
    loras = ["a", None, "b", "c", "b", None, "a", "c", "a"]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(loras))]
    sp = {"max_new_tokens": N_NEW, "temperature": 0, "logprobs": True, "ignore_eos": True}
    with core.Engine(str(model), dtype="float32", max_total_tokens=1024, page_size=4,
                     tp_size=2, device="cpu",
                     lora_paths=[f"{n}={adapters[n]}" for n in ("a", "b", "c")],
                     max_loras_per_batch=3) as engine:
        outs = engine.generate(input_ids=prompts, lora_path=loras, sampling_params=sp)
        with pytest.raises(ValueError, match="rank 32 is over --max-lora-rank 16"):
            engine.load_lora_adapter("big", str(adapters["big"]))  # every rank refuses it
        engine.unload_lora_adapter("c")
        engine.load_lora_adapter("c2", str(adapters["c"]))
        late = engine.generate(input_ids=PROMPTS, lora_path=["c2", None, "c2"],
                               sampling_params=sp)
    for i, (out, lora) in enumerate(zip(outs, loras, strict=True)):
        toks, lps = want[lora][i % len(PROMPTS)]
        assert out["output_ids"] == toks, (i, lora)
        got = [lp for lp, _ in out["meta_info"]["output_token_logprobs"]]
        assert max(abs(g - w) for g, w in zip(got, lps, strict=True)) < 1e-4, (i, lora)
    for i, (out, lora) in enumerate(zip(late, ["c", None, "c"], strict=True)):
        assert out["output_ids"] == want[lora][i][0], (i, lora)
