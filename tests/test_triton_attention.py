"""The `triton` attention backend beyond the conformance suite: declarations, the split-KV
heuristic, invariances of the kernels, bad input, and (on a GPU) CUDA-graph capture and every
extend tiling the autotuner may pick.

CPU runs use the Triton interpreter (set before the kernel modules are imported).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from conformance.attention_reference import reference_attention  # noqa: E402
from conformance.paged_batch import AttentionCase, build_inputs  # noqa: E402
from core.contract.attention import AttentionLayerParams  # noqa: E402
from core.contract.capabilities import DeviceInfo  # noqa: E402
from core.plan.checks import check_device  # noqa: E402
from plugins.attention.triton import CAPS  # noqa: E402

pytest.importorskip("triton")
ON_GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda" if ON_GPU else "cpu")
needs_gpu = pytest.mark.gpu


def _tol(dtype: torch.dtype) -> dict:
    return {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.float16: dict(atol=3e-3, rtol=3e-3),
            torch.bfloat16: dict(atol=2.5e-2, rtol=2.5e-2)}[dtype]


def test_declaring_triton_imports_no_kernel_library():
    code = ("import sys, plugins.attention.triton as t; assert t.CAPS.requires == ('triton',); "
            "print('triton' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == "False"


def test_caps_accept_ampere_and_hopper_reject_turing_and_cpu():
    def info(cap):
        return DeviceInfo(target="cuda", device_type="cuda", capability=cap, arch=f"sm{cap}")

    assert check_device(CAPS, info(90)) == [] and check_device(CAPS, info(80)) == []
    assert any("sm80+" in r for r in check_device(CAPS, info(75)))
    assert any("device cpu not supported" in r
               for r in check_device(CAPS, DeviceInfo(target="cpu", device_type="cpu")))
    assert CAPS.cuda_graph and CAPS.sliding_window and CAPS.logit_softcap
    assert {"fp8_e4m3", "fp8_e5m2"} <= CAPS.kv_cache_dtypes


def test_split_count_depends_on_batch_shape_only_and_fills_the_gpu():
    from plugins.attention.triton.common import DecodeConfig, num_kv_splits, sm_count

    cfg = DecodeConfig()
    dev = torch.device("cpu")
    for batch in (1, 3, 32, 256, 4096):
        s = num_kv_splits(batch, 8, 1, dev, cfg)
        assert 1 <= s <= cfg.max_splits and s & (s - 1) == 0  # a power of two (tl.arange)
        if s < cfg.max_splits:  # enough programs for `waves` per SM
            assert batch * 8 * s >= sm_count(dev) * cfg.waves
    assert num_kv_splits(1, 8, 1, dev, cfg) > num_kv_splits(256, 8, 1, dev, cfg)


def _decode_case(seq_lens, **kw) -> AttentionCase:
    base = dict(mode="decode", num_kv_heads=2, group=4, head_dim=64, page_size=16,
                dtype="float16", kv_dtype="float16", seq_lens=tuple(seq_lens),
                extend_lens=(1,) * len(seq_lens))
    base.update(kw)
    return AttentionCase(**base)


@pytest.mark.parametrize("window", [None, 20])
def test_decode_result_does_not_depend_on_the_split_count(window):
    """Flash-decoding merges partial softmaxes: 1, 2 or 4 splits (some empty for the short
    requests) must agree with each other and with the reference."""
    from plugins.attention.triton.decode import decode_attention

    inputs = build_inputs(_decode_case((1, 33, 150), sliding_window=window), DEVICE, 7)
    layer, (q, k, v) = inputs.layers[0], inputs.qkv[0]
    b, pool = inputs.batch, inputs.pool
    pool.set_kv(layer.layer_id, b.out_cache_loc, k.view(3, 2, 64), v.view(3, 2, 64))
    k_buf, v_buf = pool.get_kv_buffer(layer.layer_id)
    want = reference_attention(q, k_buf, v_buf, layer, b)
    for splits in (1, 2, 4):
        out = decode_attention(q.view(3, 8, 64), k_buf, v_buf, b.req_to_token,
                               b.req_pool_indices, b.seq_lens, scaling=layer.scaling,
                               sliding_window=window, num_splits=splits)
        torch.testing.assert_close(out.view(3, -1).float(), want, **_tol(torch.float16))


def _written(case: AttentionCase, seed: int):
    """Inputs of `case` with the step's K/V already in the pool, and the fp32 reference."""
    inputs = build_inputs(case, DEVICE, seed)
    layer, (q, k, v) = inputs.layers[0], inputs.qkv[0]
    b, pool = inputs.batch, inputs.pool
    T, Hkv, D = q.shape[0], case.num_kv_heads, case.head_dim
    pool.set_kv(layer.layer_id, b.out_cache_loc, k.view(T, Hkv, D), v.view(T, Hkv, D))
    k_buf, v_buf = pool.get_kv_buffer(layer.layer_id)
    return inputs, k_buf, v_buf, reference_attention(q, k_buf, v_buf, layer, b)


# Prefixes and new-token runs that start, end and cross 16/32-token block edges (and 0 prefix).
_EDGE_SEQS = (32, 47, 33, 64, 97, 17)
_EDGE_NEWS = (32, 16, 1, 33, 48, 17)


@pytest.mark.parametrize(("group", "head_dim", "dtype", "window", "cap"), [
    (1, 64, "float16", None, None), (4, 128, "float32", None, None),
    (8, 64, "float16", 21, None), (4, 256, "float16", None, 6.0), (4, 80, "float32", 40, 9.0)])
@pytest.mark.parametrize("tile", [(32, 32), (16, 32), (32, 16), (32, 32, True), (32, 16, True)],
                         ids=lambda t: "m{}n{}".format(*t) + ("-packed" if len(t) > 2 else ""))
def test_extend_tilings_at_block_edges(group, head_dim, dtype, window, cap, tile):
    """The unmasked prefix loop / causal diagonal split at every kind of block edge: prefixes
    and extensions that are and are not multiples of BLOCK_M / BLOCK_N, block_m smaller and
    larger than block_n, GQA 1/4/8, head dims 64..256 (80: padded, masked head dim), with a
    window and a soft-cap; packed tilings put a GQA group's heads in one program (4 or 8 heads
    x 8 or 4 positions per 32 rows; group 1 runs unpacked)."""
    from plugins.attention.triton.common import ExtendConfig
    from plugins.attention.triton.extend import extend_attention

    case = AttentionCase("extend", 1, group, head_dim, 16, dtype, dtype, _EDGE_SEQS, _EDGE_NEWS,
                         sliding_window=window, logit_softcap=cap)
    inputs, k_buf, v_buf, want = _written(case, 11)
    b, layer, q = inputs.batch, inputs.layers[0], inputs.qkv[0][0]
    T = q.shape[0]
    starts = (torch.cumsum(b.extend_lens, 0) - b.extend_lens).to(torch.int32)
    out = extend_attention(q.view(T, group, head_dim), k_buf, v_buf, b.req_to_token,
                           b.req_pool_indices, b.seq_lens, b.extend_lens, starts,
                           max(b.extend_lens_cpu), scaling=layer.scaling, sliding_window=window,
                           logit_softcap=cap,
                           config=ExtendConfig(*tile[:2], 1, 1, pack_gqa=len(tile) > 2))
    torch.testing.assert_close(out.view(T, -1).float(), want, **_tol(getattr(torch, dtype)))


def test_extend_offset_width_follows_the_largest_offset():
    """32-bit offset math only while every element offset (views: sum((size - 1) * stride))
    stays below 2^31; meta tensors, so nothing is allocated."""
    from plugins.attention.triton.extend import needs_int64_offsets

    meta = torch.device("meta")
    assert not needs_int64_offsets(torch.empty(2**31, device=meta))  # last offset 2^31 - 1
    assert needs_int64_offsets(torch.empty(2**31 + 1, device=meta))
    assert needs_int64_offsets(torch.empty(8, 8, device=meta).as_strided((2, 2), (2**31, 1)))
    assert not needs_int64_offsets(torch.empty(2**20, 8, 128, device=meta),
                                   torch.empty(0, device=meta))


@pytest.mark.parametrize("idx64", [False, True])
def test_extend_with_either_offset_width(monkeypatch, idx64):
    """The 64-bit offset path (taken for pools of 2^31+ elements) computes the same attention
    as the 32-bit one: forced both ways on a small case with a window and a soft-cap."""
    from plugins.attention.triton import extend
    from plugins.attention.triton.common import ExtendConfig

    monkeypatch.setattr(extend, "needs_int64_offsets", lambda *t: idx64)
    case = AttentionCase("extend", 1, 4, 64, 16, "float16", "float16", _EDGE_SEQS, _EDGE_NEWS,
                         sliding_window=40, logit_softcap=8.0)
    inputs, k_buf, v_buf, want = _written(case, 5)
    b, layer, q = inputs.batch, inputs.layers[0], inputs.qkv[0][0]
    T = q.shape[0]
    starts = (torch.cumsum(b.extend_lens, 0) - b.extend_lens).to(torch.int32)
    out = extend.extend_attention(q.view(T, 4, 64), k_buf, v_buf, b.req_to_token,
                                  b.req_pool_indices, b.seq_lens, b.extend_lens, starts,
                                  max(b.extend_lens_cpu), scaling=layer.scaling,
                                  sliding_window=40, logit_softcap=8.0,
                                  config=ExtendConfig(32, 16, 1, 1, pack_gqa=True))
    torch.testing.assert_close(out.view(T, -1).float(), want, **_tol(torch.float16))


@pytest.mark.parametrize(("group", "window", "cap"), [(1, None, None), (4, 50, None),
                                                      (8, None, 7.0)])
@pytest.mark.parametrize("block_n", [16, 32, 64])
def test_decode_groups_and_split_lengths(group, window, cap, block_n):
    """GQA 1/4/8 share one K/V load per program; split lengths round to block_n; requests of
    length 1, exactly a block, and just past a split all merge right, for 1..8 splits and a
    minimum split length that leaves some splits of the short requests empty."""
    from plugins.attention.triton.common import DecodeConfig
    from plugins.attention.triton.decode import decode_attention

    seqs = (1, block_n, 2 * block_n + 1, 200)
    case = _decode_case(seqs, num_kv_heads=2, group=group, head_dim=64,
                        sliding_window=window, logit_softcap=cap)
    inputs, k_buf, v_buf, want = _written(case, 5)
    b, layer, q = inputs.batch, inputs.layers[0], inputs.qkv[0][0]
    for splits in (1, 3, 8):
        cfg = DecodeConfig(block_n=block_n, num_warps=1, num_stages=1, min_split_tokens=40)
        out = decode_attention(q.view(len(seqs), 2 * group, 64), k_buf, v_buf, b.req_to_token,
                               b.req_pool_indices, b.seq_lens, scaling=layer.scaling,
                               sliding_window=window, logit_softcap=cap, num_splits=splits,
                               config=cfg)
        torch.testing.assert_close(out.view(len(seqs), -1).float(), want,
                                   **_tol(torch.float16), msg=lambda m, s=splits: f"{s}: {m}")


def test_split_count_follows_context_and_graph_buckets_are_fixed():
    """Eager decode splits by the step's longest context (short ones split less); a graph's
    split count comes from the longest context it may replay (init_graph_state), not from the
    capture batch's values."""
    from plugins.attention.triton.backend import TritonAttention
    from plugins.attention.triton.common import DecodeConfig, num_kv_splits

    dev = torch.device("cpu")
    cfg = DecodeConfig(min_split_tokens=256)
    assert num_kv_splits(1, 8, 1, dev, cfg, context=512) == 2
    assert num_kv_splits(1, 8, 1, dev, cfg, context=100) == 1
    assert num_kv_splits(1, 8, 1, dev, cfg, context=1 << 20) == num_kv_splits(1, 8, 1, dev, cfg)
    assert num_kv_splits(4096, 8, 1, dev, cfg, context=1 << 20) == 1
    inputs = build_inputs(_decode_case((5, 3000)), DEVICE, 0)
    backend = TritonAttention(inputs.ctx)
    short = backend.prepare(inputs.batch).num_splits
    backend.init_graph_state(8, 1 << 16)
    batch = inputs.batch
    batch.seq_lens_cpu = [1] * batch.batch_size  # what a graph runner's capture batch carries
    graph = backend.prepare_for_graph(batch, batch.batch_size).num_splits
    assert graph >= short >= 1
    batch.seq_lens_cpu = [4000] * batch.batch_size
    assert backend.prepare_for_graph(batch, batch.batch_size).num_splits == graph


def test_width_keys_cover_every_head_dim_class_and_every_table_has_them():
    """16-bit head dims up to 64 / 128 / 256 and everything fp32 or wider each have their
    tables' key, and every arch has an entry for each (d256 starts as the wide one)."""
    import torch

    from plugins.attention.triton import tuning
    from plugins.attention.triton.common import width_key

    bf, fp = torch.bfloat16, torch.float32
    assert [width_key(d, d, bf) for d in (64, 128, 256, 512)] == ["d64", "d128", "d256", "wide"]
    assert width_key(192, 128, torch.float16) == "d256" and width_key(64, 64, fp) == "wide"
    for arch in ("sm90", "sm80", "rocm"):
        for width in ("d64", "d128", "d256", "wide"):
            assert (arch, width) in tuning.DECODE and (arch, width) in tuning.EXTEND


def test_extend_tables_build_configs_and_register_caps_reach_the_launch():
    """Every extend table entry is a well-formed ExtendConfig; a maxnreg cap is passed to the
    launch (and to the autotuner's triton.Config) only when the entry sets one."""
    from plugins.attention.triton import tuning
    from plugins.attention.triton.common import ExtendConfig
    from plugins.attention.triton.extend import _tuned_kernel

    capped = 0
    for key, entries in tuning.EXTEND.items():
        for entry in entries:
            cfg = ExtendConfig(*entry)
            opts = cfg.launch_options()
            assert opts["num_warps"] == entry[2] and opts["num_stages"] == entry[3], key
            if len(entry) > 5:
                capped += 1
                # a cap must leave at least one program of this size on an SM (64K registers)
                assert opts["maxnreg"] == entry[5] and entry[5] * 32 * entry[2] <= 65536, key
            else:
                assert "maxnreg" not in opts, key
    assert capped >= 1
    assert "maxnreg" not in ExtendConfig().launch_options()
    tuner = _tuned_kernel([ExtendConfig(128, 64, 8, 3, True, 128), ExtendConfig()], 4)
    assert [c.maxnreg for c in tuner.configs] == [128, None]


def test_backend_rejects_bad_settings():
    from core.contract.attention import BackendContext
    from plugins.attention.triton.backend import TritonAttention

    def ctx(**kw):
        base = dict(num_heads=8, num_kv_heads=2, head_dim=64, num_layers=1,
                    dtype=torch.float16, kv_dtype=torch.float16, device=DEVICE, page_size=1,
                    max_context_len=64)
        base.update(kw)
        return BackendContext(**base)

    with pytest.raises(ValueError, match="head sizes"):
        TritonAttention(ctx(head_dim=48))
    with pytest.raises(ValueError, match="float16, bfloat16 or float32"):
        TritonAttention(ctx(dtype=torch.float64))
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        TritonAttention(ctx(num_heads=6, num_kv_heads=4))
    inputs = build_inputs(_decode_case((5,)), DEVICE, 0)
    backend = TritonAttention(inputs.ctx)
    q, k, v = inputs.qkv[0]
    bad = AttentionLayerParams(layer_id=1, num_heads=8, num_kv_heads=2, head_dim=64,
                               scaling=0.125, sliding_window=0)
    with pytest.raises(ValueError, match="sliding window must be >= 1"):
        backend.forward(q, k, v, bad, inputs.batch)


@needs_gpu
@pytest.mark.skipif(not ON_GPU, reason="needs CUDA")
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_decode_replays_in_a_cuda_graph_with_longer_contexts(dtype):
    """cuda_graph=True: capture one decode step, then replay it after the requests have grown
    (new seq_lens / table / slots written into the captured tensors)."""
    from plugins.attention.triton.backend import TritonAttention

    short = _decode_case((3, 40, 17, 64), dtype=dtype, kv_dtype=dtype, num_kv_heads=8,
                         head_dim=128, page_size=16)
    long = _decode_case((2000, 4100, 17, 900), dtype=dtype, kv_dtype=dtype, num_kv_heads=8,
                        head_dim=128, page_size=16)
    a, b = build_inputs(short, DEVICE, 1), build_inputs(long, DEVICE, 2)
    # Captured tensors must stay put: give `a` a table and pool big enough for `b`.
    a.batch.req_to_token = b.batch.req_to_token.clone()
    a.batch.kv_pool = b.pool
    a.batch.req_pool_indices.copy_(b.batch.req_pool_indices)
    a.batch.out_cache_loc.copy_(b.batch.out_cache_loc)
    backend = TritonAttention(b.ctx)
    batch = a.batch
    batch.attn_meta = backend.prepare(batch)
    layer = b.layers[0]
    q, k, v = (t.clone() for t in a.qkv[0])
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up (compiles) outside the capture
        backend.forward(q, k, v, layer, batch)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.forward(q, k, v, layer, batch)
    for dst, src in zip((q, k, v), b.qkv[0], strict=True):
        dst.copy_(src)
    batch.seq_lens.copy_(b.batch.seq_lens)
    graph.replay()
    torch.cuda.synchronize()
    k_buf, v_buf = b.pool.get_kv_buffer(layer.layer_id)
    want = reference_attention(b.qkv[0][0], k_buf, v_buf, layer, b.batch)
    torch.testing.assert_close(out.float(), want, **_tol(getattr(torch, dtype)))


@needs_gpu
@pytest.mark.skipif(not ON_GPU, reason="needs CUDA")
@pytest.mark.parametrize(("dtype", "head_dim"), [(torch.bfloat16, 64), (torch.bfloat16, 128),
                                                 (torch.float16, 256), (torch.float32, 128)])
def test_every_extend_tiling_is_correct(dtype, head_dim):
    """The autotuner may pick any candidate tiling: each one must be right on its own."""
    from plugins.attention.triton.common import extend_configs
    from plugins.attention.triton.extend import extend_attention

    name = str(dtype).split(".")[-1]
    case = AttentionCase("extend", 4, 4, head_dim, 16, name, name, (700, 300, 1200),
                         (700, 45, 513), sliding_window=None)
    inputs = build_inputs(case, DEVICE, 3)
    layer, (q, k, v) = inputs.layers[0], inputs.qkv[0]
    b, pool = inputs.batch, inputs.pool
    T = q.shape[0]
    pool.set_kv(layer.layer_id, b.out_cache_loc, k.view(T, 4, head_dim), v.view(T, 4, head_dim))
    k_buf, v_buf = pool.get_kv_buffer(layer.layer_id)
    want = reference_attention(q, k_buf, v_buf, layer, b)
    starts = (torch.cumsum(b.extend_lens, 0) - b.extend_lens).to(torch.int32)
    for cfg in extend_configs(head_dim, head_dim, dtype, DEVICE):
        out = extend_attention(q.view(T, 16, head_dim), k_buf, v_buf, b.req_to_token,
                               b.req_pool_indices, b.seq_lens, b.extend_lens, starts,
                               max(b.extend_lens_cpu), scaling=layer.scaling, config=cfg)
        torch.testing.assert_close(out.view(T, -1).float(), want, **_tol(dtype),
                                   msg=lambda m, c=cfg: f"tiling {c}: {m}")


@needs_gpu
@pytest.mark.skipif(not ON_GPU, reason="needs CUDA")
def test_extend_reads_past_two_to_the_31_elements():
    """A pool of more than 2^31 elements per buffer (2^24 + 64 slots x 1 KV head x 128) with the
    request's keys in its last slots: the kernel must take the 64-bit offset path and read
    them right (32-bit offsets would wrap to the wrong rows)."""
    from plugins.attention.triton.extend import extend_attention, needs_int64_offsets

    torch.manual_seed(0)
    dev, dt, D, H = torch.device("cuda"), torch.bfloat16, 128, 4
    slots_total = 2**24 + 64
    k_buf = torch.empty(slots_total, 1, D, dtype=dt, device=dev)
    v_buf = torch.empty_like(k_buf)
    assert needs_int64_offsets(k_buf)
    prefix, new = 200, 100
    L = prefix + new
    slots = torch.arange(slots_total - L, slots_total, device=dev)
    k_buf[slots] = torch.randn(L, 1, D, dtype=dt, device=dev)
    v_buf[slots] = torch.randn(L, 1, D, dtype=dt, device=dev)
    q = torch.randn(new, H, D, dtype=dt, device=dev)
    i32 = lambda *x: torch.tensor(x, dtype=torch.int32, device=dev)  # noqa: E731
    out = extend_attention(q, k_buf, v_buf, slots.to(torch.int32)[None], i32(0), i32(L),
                           i32(new), i32(0), new, scaling=D ** -0.5)
    k, v = k_buf[slots, 0].float(), v_buf[slots, 0].float()
    scores = (q.float().transpose(0, 1) @ k.T) * D ** -0.5  # [H, new, L]
    visible = torch.arange(L, device=dev)[None, :] <= torch.arange(prefix, L, device=dev)[:, None]
    want = torch.softmax(scores.masked_fill(~visible, float("-inf")), -1) @ v
    torch.testing.assert_close(out.float(), want.transpose(0, 1), **_tol(dt))
