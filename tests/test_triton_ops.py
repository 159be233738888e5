"""The fused GPU element-wise kernels (plugins/ops/triton) against the PyTorch layers they
replace. On the CPU they run under the Triton interpreter (fp32 / fp16 only: bf16 arithmetic is
not exact there); on a GPU (`-m gpu`) also in bf16."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from core.layers.activation import GatedAct  # noqa: E402
from core.layers.norm import RMSNorm  # noqa: E402
from core.layers.rotary import RotaryEmbedding, apply_rotary  # noqa: E402
from plugins.ops.triton import kernels as triton_ops  # noqa: E402
from plugins.ops.triton.ops import TritonLayerOps  # noqa: E402

ON_GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda" if ON_GPU else "cpu")
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if ON_GPU else [])
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def _close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> None:
    torch.testing.assert_close(a.float(), b.float(), atol=TOL[dtype], rtol=TOL[dtype])


def _norm(n: int, dtype: torch.dtype) -> RMSNorm:
    norm = RMSNorm(n, 1e-5, dtype, DEVICE)
    norm.weight.data.uniform_(0.5, 1.5)
    return norm


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [96, 576, 4096])
def test_rms_norm_matches_the_layer(dtype, n):
    torch.manual_seed(0)
    norm = _norm(n, dtype)
    x = torch.randn(7, n, dtype=dtype, device=DEVICE) * 3
    _close(triton_ops.rms_norm(x, norm.weight, norm.eps), norm._norm(x), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_returns_the_norm_and_the_sum(dtype):
    torch.manual_seed(1)
    norm = _norm(200, dtype)
    x = torch.randn(5, 200, dtype=dtype, device=DEVICE)
    r = torch.randn(5, 200, dtype=dtype, device=DEVICE)
    out, total = triton_ops.add_rms_norm(x, r, norm.weight, norm.eps)
    assert torch.equal(total, x + r)  # the sum is rounded exactly like torch's add
    _close(out, norm._norm(x + r), dtype)
    # rows are independent: a row's result does not depend on its neighbours
    out1, _ = triton_ops.add_rms_norm(x[2:3], r[2:3], norm.weight, norm.eps)
    assert torch.equal(out1[0], out[2])


@pytest.mark.parametrize("dtype", DTYPES)
def test_norm_add_norm_is_the_two_norm_kernels_in_one(dtype):
    """Gemma's post-norm, residual add and next norm in one kernel: the numbers of rms_norm then
    add_rms_norm (exact under the interpreter; on a GPU the compiler may contract fp32's
    product and sum into one FMA), through RMSNorm.bound_add_norm."""
    torch.manual_seed(4)
    ops = TritonLayerOps(dtype, DEVICE)
    n1, n2 = (RMSNorm(200, 1e-6, dtype, DEVICE, ops) for _ in range(2))
    for n in (n1, n2):
        n.weight.data.uniform_(0.5, 1.5)
    f = n1.bound_add_norm(n2)
    assert f.func is triton_ops.norm_add_norm
    h = torch.randn(5, 200, dtype=dtype, device=DEVICE) * 3
    r = torch.randn(5, 200, dtype=dtype, device=DEVICE) * 8
    want = triton_ops.add_rms_norm(triton_ops.rms_norm(h, n1.weight, 1e-6), r, n2.weight, 1e-6)
    for got, w in zip(f(h, r), want, strict=True):
        if ON_GPU:
            _close(got, w, dtype)
        else:
            assert torch.equal(got, w)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [64, 1000, 2304])
def test_silu_and_mul_matches_gated_act(dtype, inter):
    torch.manual_seed(2)
    x = torch.randn(3, 2 * inter, dtype=dtype, device=DEVICE) * 4
    gate, up = x.chunk(2, dim=-1)
    _close(triton_ops.silu_and_mul(x), torch.nn.functional.silu(gate) * up, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", [(4, 2), (6, 6), (32, 8)])
@pytest.mark.parametrize("head_dim", [16, 64, 128])
def test_rotary_qk_matches_apply_rotary(dtype, heads, head_dim):
    torch.manual_seed(3)
    hq, hk = heads
    T = 5
    rope = RotaryEmbedding(head_dim, {"rope_theta": 10000.0, "rope_type": "default"}, 4096,
                           DEVICE)
    positions = torch.tensor([0, 1, 17, 300, 4095], device=DEVICE)
    cos, sin = rope.cos_sin(positions, dtype)
    qkv = torch.randn(T, (hq + 2 * hk) * head_dim, dtype=dtype, device=DEVICE)
    q, k = triton_ops.rotary_qk(qkv, cos, sin, hq, hk, head_dim)
    ref = apply_rotary(qkv[:, :(hq + hk) * head_dim].view(T, hq + hk, head_dim), cos, sin)
    assert q.is_contiguous() and k.is_contiguous()
    _close(q.view(T, hq, head_dim), ref[:, :hq], dtype)
    _close(k.view(T, hk, head_dim), ref[:, hq:], dtype)


def test_empty_batches_launch_nothing():
    norm = _norm(64, torch.float32)
    x = torch.empty(0, 64, device=DEVICE)
    assert triton_ops.rms_norm(x, norm.weight, 1e-5).shape == (0, 64)
    assert triton_ops.add_rms_norm(x, x, norm.weight, 1e-5)[0].shape == (0, 64)
    assert triton_ops.norm_add_norm(x, x, norm.weight, norm.weight, 1e-5)[1].shape == (0, 64)
    assert triton_ops.silu_and_mul(torch.empty(0, 128, device=DEVICE)).shape == (0, 64)


def test_the_engine_uses_them_on_gpus_only_and_they_can_be_turned_off(model_spec, monkeypatch):
    from core.plan.args import ServerArgs, apply_environment, make_server_args
    from core.plan.devices import PROFILES
    from core.plan.registry import build_registry
    from core.plan.resolver import resolve

    test_registry = build_registry()
    spec = model_spec("llama-3.1-8b")
    assert resolve(spec, PROFILES["h100"], ServerArgs(), test_registry).layer_ops == "triton"
    cpu = resolve(spec, PROFILES["xeon-amx"], ServerArgs(), test_registry)
    # the interpreter is for tests, never the engine: the CPU's own C ops (AVX-512 build)
    assert cpu.layer_ops == "cpu_c_avx512"
    why = next(c for c in cpu.candidates if c.slot == "layer_ops" and c.name == "triton")
    assert "device cpu not supported" in why.reasons[0]
    # The environment is read at the edge (core.plan.args), so the resolver stays pure.
    monkeypatch.setenv("CORE_DISABLE_FUSED_OPS", "1")
    assert resolve(spec, PROFILES["h100"], ServerArgs(), test_registry).layer_ops == "triton"
    args = make_server_args()
    assert args.layer_ops == "torch"
    assert resolve(spec, PROFILES["h100"], args, test_registry).layer_ops == "torch"
    assert make_server_args(layer_ops="triton").layer_ops == "triton"  # the flag wins
    assert apply_environment(ServerArgs(), {}).layer_ops is None


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs CUDA")
def test_the_layers_take_the_fused_path_on_the_gpu():
    ops = TritonLayerOps(torch.bfloat16, DEVICE)
    norm = RMSNorm(256, 1e-5, torch.bfloat16, DEVICE, ops)
    assert norm.bound().func is triton_ops.rms_norm
    act = GatedAct("silu", ops)
    assert act._fused is triton_ops.silu_and_mul
    x = torch.randn(4, 512, dtype=torch.bfloat16, device=DEVICE)
    gate, up = x.chunk(2, dim=-1)
    _close(act(x), torch.nn.functional.silu(gate) * up, torch.bfloat16)


@pytest.mark.parametrize("dtype", DTYPES)
def test_store_kv_writes_exactly_the_slots(dtype):
    torch.manual_seed(4)
    T, Hkv, D, size = 6, 2, 32, 40
    qkv = torch.randn(T, (4 + 2 * Hkv) * D, dtype=dtype, device=DEVICE)
    k = torch.randn(T, Hkv, D, dtype=dtype, device=DEVICE)
    v = qkv[:, (4 + Hkv) * D:].view(T, Hkv, D)  # a strided view, as the model passes it
    k_buf = torch.full((size, Hkv, D), 7.0, dtype=dtype, device=DEVICE)
    v_buf = torch.full((size, Hkv, D), 7.0, dtype=dtype, device=DEVICE)
    loc = torch.tensor([3, 39, 0, 12, 13, 5], device=DEVICE)
    assert triton_ops.can_store_kv(k, v, k_buf, v_buf)
    triton_ops.store_kv(k, v, loc, k_buf, v_buf)
    assert torch.equal(k_buf[loc], k) and torch.equal(v_buf[loc], v)
    untouched = torch.ones(size, dtype=torch.bool)
    untouched[loc.cpu()] = False
    assert (k_buf[untouched.to(DEVICE)] == 7).all() and (v_buf[untouched.to(DEVICE)] == 7).all()


@pytest.mark.parametrize("m", [1, 2, 3, 4])
@pytest.mark.parametrize("split_tiles", [None, (8, 64, 4, 8)])
def test_gemv_rows_and_splits(m, split_tiles):
    """The few-row product (the `linear` op's kernel) for 1..4 rows, unsplit and with K split
    over several programs (the last summing in order), bias on odd sizes; the lock counts are
    left at zero for the next call."""
    from plugins._kit.splitk import LockTable
    from plugins.ops.triton import gemv

    g = torch.Generator().manual_seed(m)
    n, k = 37, 640
    w = (torch.randn(n, k, generator=g) * k ** -0.5).to(DEVICE)
    b = torch.randn(n, generator=g).to(DEVICE)
    x = torch.randn(m, k, generator=g).to(DEVICE)
    cfg = gemv.config(n, k, DEVICE, split_tiles)
    if split_tiles is not None:
        assert cfg["SPLIT_K"] > 1
    _close(gemv.gemv(x, w, b, cfg), torch.nn.functional.linear(x, w, b), torch.float32)
    if cfg["SPLIT_K"] > 1:
        assert not LockTable.get(DEVICE, 1).any()


@pytest.mark.skipif(ON_GPU, reason="the interpreter's check (fp32 on the CPU)")
def test_tiny_gemma_on_the_triton_ops_matches_the_torch_ops(tmp_path, monkeypatch):
    """A whole Gemma 2 layer stack on the triton layer ops (its fused norm + add + norm once a
    layer among them) against the torch ops: fp32 under the interpreter, dummy weights with
    norms of distinct weights."""
    import dataclasses

    from model_fixtures import cpu_plan, prefill_logits, tiny_config, write_config_model

    from core.engine.loader import load_model
    from core.plan.args import make_server_args
    from core.plan.registry import build_registry

    calls = []

    def norm_add_norm(*args, **kw):
        calls.append(args[0].shape)
        return fused(*args, **kw)

    fused = triton_ops.norm_add_norm
    monkeypatch.setattr(triton_ops, "norm_add_norm", norm_add_norm)
    path = write_config_model(tmp_path, tiny_config("gemma2").to_dict())
    registry, logits = build_registry(), {}
    for name in ("torch", "triton"):
        plan = dataclasses.replace(cpu_plan("gemma2"), layer_ops=name)
        model = load_model(make_server_args(model_path=str(path), load_format="dummy"), plan,
                           registry).model
        g = torch.Generator().manual_seed(0)
        for norm in model.norms():  # dummy norms are all ones: swapped weights would pass
            norm.weight.uniform_(0.5, 1.5, generator=g)
        logits[name] = prefill_logits(model, model.config, list(range(3, 20)))
    assert len(calls) == model.config.num_hidden_layers and calls[0] == (17, 64)
    torch.testing.assert_close(logits["triton"], logits["torch"], rtol=1e-4, atol=1e-4)
