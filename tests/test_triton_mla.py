"""The `triton_mla` backend (MLA in Triton, plugins/attention/triton_mla): the MLA conformance
case (fp32 at page sizes 1 / 16 / 64, fp16), the kernels at awkward sizes (many splits, odd
lengths, head counts that are not a multiple of the head block, extends over many chunks), the
split policy and graph metadata, refusals, and a planted bug the tests must catch.

CPU runs use the Triton interpreter (set before the kernel modules are imported; fp32 and fp16
only: it computes bf16 dots wrongly). On a GPU, `pytest -m gpu tests/test_triton_mla.py` checks
bf16 at DeepSeek's shapes (16 and 128 heads, latent 576, contexts up to 32k) against the fp32
reference, and decode captured in a CUDA graph and replayed over longer contexts.

The backend is registered in-process here, so these tests do not depend on the installed entry
points (test_cli's resolve test does).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

import plugins.attention.triton_mla as triton_mla_plugin  # noqa: E402
from conformance.attention_check import TOLERANCES  # noqa: E402
from conformance.mla_suite import MLAParam, check_mla_case, mla_reference  # noqa: E402
from core.contract.attention import BackendContext  # noqa: E402
from core.contract.forward_batch import ForwardBatch, ForwardMode  # noqa: E402
from core.contract.mla import MLALayerParams, MLAWeights  # noqa: E402
from core.engine.memory.kv_cache import MLAKVPool  # noqa: E402
from core.plan.registry import build_registry  # noqa: E402

ON_GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda" if ON_GPU else "cpu")


def gpu_test(fn):
    """Marked `gpu` (left out of the default run) and skipped without CUDA."""
    return pytest.mark.gpu(pytest.mark.skipif(not ON_GPU, reason="needs CUDA")(fn))


def _registration():
    registry = build_registry(extra=[("attention_triton_mla", triton_mla_plugin)],
                              entry_points=False)
    assert not registry.failures, registry.failures
    return registry.get("attention", "triton_mla")


def _layer(H, R, Dn, Dr, Dv, layer_id=0):
    return MLALayerParams(layer_id=layer_id, num_heads=H, kv_lora_rank=R, qk_nope_head_dim=Dn,
                          qk_rope_head_dim=Dr, v_head_dim=Dv, scaling=(Dn + Dr) ** -0.5 * 1.1)


def _weights(H, R, Dn, Dv, g, dtype, device):
    kv_b = torch.randn(H * (Dn + Dv), R, generator=g) / R ** 0.5
    return MLAWeights.split(kv_b.to(device, dtype), H, Dn)


def _tol(dtype: torch.dtype) -> dict:
    atol, rtol = TOLERANCES[str(dtype).removeprefix("torch.")]
    return dict(atol=atol, rtol=rtol)


# -- declarations --------------------------------------------------------------------------------

def test_declaring_triton_mla_imports_no_kernel_library():
    code = ("import sys, plugins.attention.triton_mla as t; "
            "assert t.CAPS.requires == ('triton',); print('triton' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_caps_declare_mla_on_cuda_above_the_reference():
    from plugins.attention.torch_native_mla import CAPS as REFERENCE

    caps = triton_mla_plugin.CAPS
    assert caps.attention_kinds == {"MLA"} and caps.devices == {"cuda"}
    assert caps.priority["cuda"] > REFERENCE.priority["cuda"]
    assert not any(d.startswith("fp8") for d in caps.kv_cache_dtypes)
    assert caps.cuda_graph and caps.phases == {"prefill", "decode"}


# -- the conformance case ------------------------------------------------------------------------

SMALL, DEEPSEEK = (4, 64, 32, 16, 24), (2, 512, 128, 64, 128)


@pytest.mark.parametrize(("page", "shape", "dtype"), [
    (1, SMALL, "float32"), (16, SMALL, "float32"), (64, SMALL, "float32"),
    (16, DEEPSEEK, "float32"), (16, SMALL, "float16"), (64, DEEPSEEK, "float16")])
def test_conformance_case(page, shape, dtype):
    check_mla_case(MLAParam(_registration(), str(DEVICE), page, shape, dtype))


def test_a_planted_bug_fails_the_conformance_case(monkeypatch):
    """A softmax scale off by 5% (the scaling constant the kernels fold log2(e) into) must not
    pass: the suite is able to fail this backend."""
    import plugins.attention.triton_mla.decode as decode
    import plugins.attention.triton_mla.extend as extend

    monkeypatch.setattr(decode, "LOG2E_F", decode.LOG2E_F * 1.05)
    monkeypatch.setattr(extend, "LOG2E_F", extend.LOG2E_F * 1.05)
    with pytest.raises(AssertionError):
        check_mla_case(MLAParam(_registration(), str(DEVICE), 16, SMALL, "float32"))


# -- the kernels at awkward sizes ----------------------------------------------------------------

def _paged_rows(S_total: int, width: int, page: int, g, dtype, device):
    """A latent buffer with one request's S_total rows on shuffled pages: (buf, slots [S])."""
    pages = -(-S_total // page) + 3
    buf = torch.randn(pages * page, width, generator=g).to(device, dtype)
    order = (torch.randperm(pages - 1, generator=g) + 1)[:-(-S_total // page)]
    slots = (order[:, None] * page + torch.arange(page)).flatten()[:S_total]
    return buf, slots.to(device)


@pytest.mark.parametrize(("H", "seq_lens", "splits", "page", "dtype"), [
    (5, (1, 17, 70), 1, 1, torch.float32),  # one split; H below the head block
    (19, (33, 2, 96), 8, 16, torch.float32),  # many splits; H over one head block
    (16, (129, 64), 3, 64, torch.float16),  # a split count that is no power of two
])
def test_decode_kernel_matches_the_reference(H, seq_lens, splits, page, dtype):
    from plugins.attention.triton_mla.decode import MLADecodeConfig, mla_decode

    R, Dn, Dr, Dv = 64, 32, 16, 24
    g = torch.Generator().manual_seed(H)
    layer, w = _layer(H, R, Dn, Dr, Dv), _weights(H, R, Dn, Dv, g, dtype, DEVICE)
    B, longest = len(seq_lens), max(seq_lens)
    buf, _ = _paged_rows(B * longest + 4 * page, R + Dr, page, g, dtype, DEVICE)
    table = torch.zeros(B, longest + page, dtype=torch.int32, device=DEVICE)
    perm = (torch.randperm(buf.shape[0] - 1, generator=g) + 1).to(DEVICE)
    for b, s in enumerate(seq_lens):
        table[b, :s] = perm[b * longest:b * longest + s].to(torch.int32)
    q_n = torch.randn(B, H, Dn, generator=g).to(DEVICE, dtype)
    q_r = torch.randn(B, H, Dr, generator=g).to(DEVICE, dtype)
    # min_split_tokens 8: short contexts still spread over every split; the merge weighs 3
    # splits at a time (ragged last chunks at 3 splits) over slices of 16 latent values
    cfg = MLADecodeConfig(16, 1, 1, 1, 8, 8, block_h=16, merge_splits=2, merge_dv=16, merge_h=2)
    out = mla_decode(q_n, q_r, buf, w, layer, table, torch.arange(B, device=DEVICE),
                     torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE), splits, cfg)
    assert out.shape == (B, H, Dv) and out.dtype == dtype
    for b, s in enumerate(seq_lens):
        want = mla_reference(q_n[b:b + 1], q_r[b:b + 1], buf[table[b, :s].long()], w, layer,
                             absorbed=True)
        torch.testing.assert_close(out[b:b + 1].float(), want, **_tol(dtype),
                                   msg=lambda m, b=b: f"request {b} of {seq_lens}: {m}")


@pytest.mark.parametrize(("B", "H", "K", "N", "dtype"), [
    (1, 3, 48, 80, torch.float32),  # batch 1, sizes off the tiles
    (17, 2, 64, 24, torch.float16),  # two row blocks' worth in one of 32
    (5, 4, 130, 20, torch.float32),  # K past one 64-wide step with a ragged tail
    (0, 2, 16, 16, torch.float32),  # an empty step
    (40, 2, 32, 24, torch.float32),  # past the 32-row limit: torch.bmm
])
def test_head_matmul_matches_bmm(B, H, K, N, dtype):
    """The absorbed per-head products: x [B, H, K] (here a transposed view, as the latent
    comes) @ w [H, K, N] (here a transposed view, as w_vc^T comes) against torch.bmm in fp32."""
    from plugins.attention.triton_mla.decode import head_matmul

    g = torch.Generator().manual_seed(B * 7 + K)
    x = torch.randn(H, B, K, generator=g).to(DEVICE, dtype).transpose(0, 1)
    w = torch.randn(H, N, K, generator=g).to(DEVICE, dtype).transpose(1, 2)
    got = head_matmul(x, w, max_rows=32)  # the kernel whatever the shipped default
    want = torch.bmm(x.float().transpose(0, 1), w.float()).transpose(0, 1)
    assert got.shape == (B, H, N) and got.dtype == dtype
    torch.testing.assert_close(got.float(), want, **_tol(dtype))


@pytest.mark.parametrize(("prefix", "new", "chunk", "H", "dtype"), [
    (0, 37, 16, 3, torch.float32),  # prefill over three chunks, the last one ragged
    (45, 7, 16, 5, torch.float32),  # a cached prefix longer than the chunk
    (100, 1, 32, 2, torch.float16),  # one new token at the end of four chunks
    (13, 21, 1024, 4, torch.float16),  # everything in one chunk
])
def test_extend_kernel_carries_its_state_across_chunks(prefix, new, chunk, H, dtype):
    from plugins.attention.triton_mla.extend import extend_request

    R, Dn, Dr, Dv = 48, 24, 16, 20  # no power of two but Dr
    g = torch.Generator().manual_seed(prefix * 7 + new)
    layer, w = _layer(H, R, Dn, Dr, Dv), _weights(H, R, Dn, Dv, g, dtype, DEVICE)
    buf, slots = _paged_rows(prefix + new, R + Dr, 16, g, dtype, DEVICE)
    q_n = torch.randn(new, H, Dn, generator=g).to(DEVICE, dtype)
    q_r = torch.randn(new, H, Dr, generator=g).to(DEVICE, dtype)
    out = torch.full((new, H, Dv), float("nan"), dtype=dtype, device=DEVICE)
    extend_request(q_n, q_r, slots, buf, w, layer, out, chunk=chunk)
    want = mla_reference(q_n, q_r, buf[slots], w, layer, absorbed=False)
    torch.testing.assert_close(out.float(), want, **_tol(dtype))


@pytest.mark.parametrize(("reqs", "chunk", "dtype"), [
    # (prefix, new) per request: groups of several, a long request alone (more keys than a
    # chunk) between them, a lone new token, one request whose keys fill the chunk exactly
    (((0, 37), (45, 7), (100, 1), (13, 21), (0, 5), (48, 16)), 64, torch.float32),
    (((5, 3), (0, 70), (2, 1)), 80, torch.float16),
    (((0, 9),), 1024, torch.float32),
])
def test_extend_batch_groups_requests_and_matches_the_reference(reqs, chunk, dtype):
    """A step's requests extended together (plan_extend's groups: one gather, one expansion
    and one launch for requests whose keys fit a chunk together; the chunk loop for longer
    ones), each request's rows against the reference over its own rows."""
    from plugins.attention.triton_mla.extend import ExtendConfig, extend_batch, plan_extend

    H, R, Dn, Dr, Dv, page = 3, 48, 24, 16, 20, 8
    g = torch.Generator().manual_seed(len(reqs) * 31 + chunk)
    layer, w = _layer(H, R, Dn, Dr, Dv), _weights(H, R, Dn, Dv, g, dtype, DEVICE)
    seq = [p + n for p, n in reqs]
    buf, slots = _paged_rows(sum(seq), R + Dr, page, g, dtype, DEVICE)
    table = torch.zeros(len(reqs) + 2, max(seq) + 3, dtype=torch.int32, device=DEVICE)
    rows = torch.randperm(len(reqs) + 2, generator=g)[:len(reqs)].to(DEVICE)  # pool rows
    own, at = [], 0
    for i, s_ in enumerate(seq):
        own.append(slots[at:at + s_])
        table[rows[i], :s_] = own[-1].to(torch.int32)
        at += s_
    T = sum(n for _, n in reqs)
    q_n = torch.randn(T, H, Dn, generator=g).to(DEVICE, dtype)
    q_r = torch.randn(T, H, Dr, generator=g).to(DEVICE, dtype)
    out = torch.full((T, H, Dv), float("nan"), dtype=dtype, device=DEVICE)
    cfg = ExtendConfig(16, 16, 1, 1)
    groups = plan_extend(table, rows, seq, [n for _, n in reqs], chunk, cfg.block_m)
    assert sum(gr.count for gr in groups) == len(reqs)
    assert len(reqs) == 1 or any(gr.count > 1 for gr in groups)  # some launch serves several
    for gr in groups:  # grouped: their keys fit the chunk together; alone: too long for it
        keys = sum(seq[gr.first:gr.first + gr.count])
        assert keys <= chunk if gr.blocks is not None else (gr.count == 1 and keys > chunk)
    extend_batch(q_n, q_r, groups, buf, w, layer, out, config=cfg)
    at = 0
    for (_, n), mine in zip(reqs, own, strict=True):
        want = mla_reference(q_n[at:at + n], q_r[at:at + n], buf[mine], w, layer,
                             absorbed=False)
        torch.testing.assert_close(out[at:at + n].float(), want, **_tol(dtype))
        at += n


# -- split policy, graphs, refusals --------------------------------------------------------------

def test_batch_one_long_context_fills_the_gpu_and_graph_splits_are_fixed(monkeypatch):
    """On a 132-SM GPU a batch-1, 32k-context step at 16 heads gets at least a program per SM;
    a graph's split count comes from the longest context it may replay, not the batch values."""
    import plugins._kit.triton_splitkv as splitkv
    from plugins.attention.triton_mla.backend import TritonMLA
    from plugins.attention.triton_mla.decode import GPU_CONFIG, decode_splits, head_blocks

    monkeypatch.setattr(splitkv, "sm_count", lambda device: 132)
    dev = torch.device("cpu")
    for heads in (16, 128):
        splits = decode_splits(1, heads, dev, context=32768, config=GPU_CONFIG)
        assert splits * head_blocks(heads, GPU_CONFIG) >= 132, heads
        assert 32768 / splits >= GPU_CONFIG.min_split_tokens
    assert decode_splits(1, 16, dev, context=GPU_CONFIG.min_split_tokens - 1,
                         config=GPU_CONFIG) == 1
    assert decode_splits(64, 128, dev, context=32768, config=GPU_CONFIG) == 1

    ctx = BackendContext(num_heads=16, num_kv_heads=1, head_dim=192, num_layers=1,
                         dtype=torch.float16, kv_dtype=torch.float16, device=dev, page_size=1,
                         max_context_len=1 << 15)
    backend = TritonMLA(ctx)
    backend.init_graph_state(8, 1 << 15)
    batch = _decode_batch(2, [1, 1])
    graph = backend.prepare_for_graph(batch, 2)
    batch.seq_lens_cpu = [30000, 5]
    assert backend.prepare_for_graph(batch, 2).num_splits == graph.num_splits > 1
    assert backend.prepare(batch).num_splits >= 1
    extend = _decode_batch(2, [3, 3])
    extend.mode = ForwardMode.EXTEND
    with pytest.raises(ValueError, match="captures decode batches only"):
        backend.prepare_for_graph(extend, 2)


def _decode_batch(bs: int, seq: list[int]) -> ForwardBatch:
    return ForwardBatch(
        mode=ForwardMode.DECODE, input_ids=torch.zeros(bs, dtype=torch.int64),
        positions=torch.zeros(bs, dtype=torch.int64), seq_lens=torch.tensor(seq),
        prefix_lens=torch.tensor(seq) - 1, extend_lens=torch.ones(bs, dtype=torch.int32),
        out_cache_loc=torch.zeros(bs, dtype=torch.int64),
        req_pool_indices=torch.arange(bs), req_to_token=torch.zeros(bs, 8, dtype=torch.int32),
        kv_pool=None, seq_lens_cpu=list(seq), prefix_lens_cpu=[s - 1 for s in seq],
        extend_lens_cpu=[1] * bs)


def test_backend_refuses_fp8_latent_and_other_dtypes():
    from plugins.attention.triton_mla.backend import TritonMLA

    def ctx(**kw):
        base = dict(num_heads=16, num_kv_heads=1, head_dim=192, num_layers=1,
                    dtype=torch.bfloat16, kv_dtype=torch.bfloat16, device=DEVICE, page_size=1,
                    max_context_len=64)
        return BackendContext(**{**base, **kw})

    with pytest.raises(ValueError, match="no FP8 latent cache"):
        TritonMLA(ctx(kv_dtype=torch.float8_e4m3fn))
    with pytest.raises(ValueError, match="float32, float16 or bfloat16"):
        TritonMLA(ctx(dtype=torch.float64))
    with pytest.raises(TypeError, match="forward_mla"):
        TritonMLA(ctx()).forward(None, None, None, None, None)


# -- GPU: DeepSeek shapes in bf16, CUDA graphs ---------------------------------------------------

def _deepseek_decode(H: int, seq_lens: list[int], dtype, seed: int, page: int = 64):
    """A decode step of DeepSeek's MLA head (R 512, Dr 64, Dn 128, Dv 128) over a paged pool."""
    R, Dn, Dr, Dv = 512, 128, 64, 128
    g = torch.Generator().manual_seed(seed)
    layer, w = _layer(H, R, Dn, Dr, Dv), _weights(H, R, Dn, Dv, g, dtype, DEVICE)
    B, width = len(seq_lens), -(-max(seq_lens) // page) * page
    pages = B * width // page + 2
    pool = MLAKVPool(pages * page, 1, R, Dr, dtype, DEVICE, page)
    pool.latent_buffers[0].copy_(torch.randn(pool.latent_buffers[0].shape, generator=g))
    order = (torch.randperm(pages - 1, generator=g) + 1).to(DEVICE)
    table = torch.zeros(B, width, dtype=torch.int32, device=DEVICE)
    per = width // page
    for b in range(B):
        own = order[b * per:(b + 1) * per]
        table[b] = (own[:, None] * page + torch.arange(page, device=DEVICE)).flatten()
    seq = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    batch = ForwardBatch(
        mode=ForwardMode.DECODE, input_ids=torch.zeros(B, dtype=torch.int64, device=DEVICE),
        positions=(seq - 1).long(), seq_lens=seq, prefix_lens=seq - 1,
        extend_lens=torch.ones(B, dtype=torch.int32, device=DEVICE),
        out_cache_loc=table[torch.arange(B, device=DEVICE), (seq - 1).long()].long(),
        req_pool_indices=torch.arange(B, device=DEVICE), req_to_token=table, kv_pool=pool,
        seq_lens_cpu=list(seq_lens), prefix_lens_cpu=[s - 1 for s in seq_lens],
        extend_lens_cpu=[1] * B)
    new = torch.randn(B, R + Dr, generator=g).to(DEVICE, dtype)
    q_n = torch.randn(B, H, Dn, generator=g).to(DEVICE, dtype)
    q_r = torch.randn(B, H, Dr, generator=g).to(DEVICE, dtype)
    return layer, w, pool, batch, new, q_n, q_r


@pytest.mark.parametrize("H", [16, 128])
@pytest.mark.parametrize("seq_lens", [[32768], [4096] * 4 + [17, 1]])
@gpu_test
def test_gpu_bf16_decode_at_deepseek_shapes(H, seq_lens):
    from plugins.attention.triton_mla.backend import TritonMLA

    dtype = torch.bfloat16
    layer, w, pool, batch, new, q_n, q_r = _deepseek_decode(H, seq_lens, dtype, H)
    backend = TritonMLA(BackendContext(H, 1, 192, 1, dtype, dtype, DEVICE, 64, 1 << 15))
    batch.attn_meta = backend.prepare(batch)
    R = layer.kv_lora_rank
    out = backend.forward_mla(q_n, q_r, new[:, :R], new[:, R:], w, layer, batch)
    buf = pool.get_latent_buffer(0)
    for b, s in enumerate(seq_lens):
        want = mla_reference(q_n[b:b + 1], q_r[b:b + 1], buf[batch.req_to_token[b, :s].long()],
                             w, layer, absorbed=True)
        torch.testing.assert_close(out[b:b + 1].view(1, H, -1).float(), want, **_tol(dtype),
                                   msg=lambda m, b=b, s=s: f"H {H} request {b} ({s} tokens): {m}")


@pytest.mark.parametrize("B", [1, 5, 32])
@pytest.mark.parametrize("H", [16, 128])
@gpu_test
def test_gpu_bf16_head_matmul_at_deepseek_shapes(B, H):
    """Both absorbed products as decode runs them (q_nope @ w_kc; o_lat @ w_vc^T, a transposed
    view), in bf16 with the kernel forced on, against fp32 bmm of the same bf16 values."""
    from plugins.attention.triton_mla.decode import head_matmul

    dtype, (R, Dn, Dv) = torch.bfloat16, (512, 128, 128)
    g = torch.Generator().manual_seed(B * 131 + H)
    w = _weights(H, R, Dn, Dv, g, dtype, DEVICE)
    q_n = torch.randn(B, H, Dn, generator=g).to(DEVICE, dtype)
    o_lat = torch.randn(B, H, R, generator=g).to(DEVICE, dtype)
    for x, wt in ((q_n, w.w_kc), (o_lat, w.w_vc.transpose(1, 2))):
        got = head_matmul(x, wt, max_rows=32)
        want = torch.bmm(x.float().transpose(0, 1), wt.float()).transpose(0, 1)
        torch.testing.assert_close(got.float(), want, **_tol(dtype))


@pytest.mark.parametrize(("H", "prefix", "new"), [(16, 9000, 700), (128, 2500, 300)])
@gpu_test
def test_gpu_bf16_extend_at_deepseek_shapes(H, prefix, new):
    from plugins.attention.triton_mla.extend import extend_request

    dtype, (R, Dn, Dr, Dv) = torch.bfloat16, (512, 128, 64, 128)
    g = torch.Generator().manual_seed(prefix)
    layer, w = _layer(H, R, Dn, Dr, Dv), _weights(H, R, Dn, Dv, g, dtype, DEVICE)
    buf, slots = _paged_rows(prefix + new, R + Dr, 64, g, dtype, DEVICE)
    q_n = torch.randn(new, H, Dn, generator=g).to(DEVICE, dtype)
    q_r = torch.randn(new, H, Dr, generator=g).to(DEVICE, dtype)
    out = torch.empty(new, H, Dv, dtype=dtype, device=DEVICE)
    extend_request(q_n, q_r, slots, buf, w, layer, out)  # the default chunk: several here
    want = mla_reference(q_n, q_r, buf[slots], w, layer, absorbed=False)
    torch.testing.assert_close(out.float(), want, **_tol(dtype))


@pytest.mark.parametrize("H", [16, 128])
@gpu_test
def test_gpu_decode_replays_in_a_cuda_graph_with_longer_contexts(H):
    """cuda_graph=True: capture one decode step of short requests, then replay it after the
    requests have grown (new seq lens, slots and inputs written into the captured tensors)."""
    from plugins.attention.triton_mla.backend import TritonMLA

    dtype = torch.bfloat16
    long_lens = [20000, 4100, 17]
    layer, w, pool, batch, new, q_n, q_r = _deepseek_decode(H, long_lens, dtype, 7)
    backend = TritonMLA(BackendContext(H, 1, 192, 1, dtype, dtype, DEVICE, 64, 1 << 15))
    backend.init_graph_state(4, 1 << 15)
    want_seq, want_loc = batch.seq_lens.clone(), batch.out_cache_loc.clone()
    # capture over short contexts: the graph must not depend on the captured values
    short = torch.tensor([3, 40, 5], dtype=torch.int32, device=DEVICE)
    batch.seq_lens.copy_(short)
    batch.out_cache_loc.copy_(batch.req_to_token[torch.arange(3, device=DEVICE),
                                                 (short - 1).long()].long())
    batch.seq_lens_cpu = short.tolist()
    batch.attn_meta = backend.prepare_for_graph(batch, 3)
    R = layer.kv_lora_rank
    inputs = [t.clone() for t in (q_n, q_r, new[:, :R], new[:, R:])]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # compile outside the capture
        backend.forward_mla(*inputs, w, layer, batch)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.forward_mla(*inputs, w, layer, batch)
    for dst, src in zip(inputs, (q_n, q_r, new[:, :R], new[:, R:]), strict=True):
        dst.copy_(src)
    batch.seq_lens.copy_(want_seq)
    batch.out_cache_loc.copy_(want_loc)
    graph.replay()
    torch.cuda.synchronize()
    buf = pool.get_latent_buffer(0)
    torch.testing.assert_close(buf[want_loc], new, rtol=0, atol=0)
    for b, s in enumerate(long_lens):
        want = mla_reference(q_n[b:b + 1], q_r[b:b + 1], buf[batch.req_to_token[b, :s].long()],
                             w, layer, absorbed=True)
        torch.testing.assert_close(out[b:b + 1].view(1, H, -1).float(), want, **_tol(dtype),
                                   msg=lambda m, b=b: f"request {b}: {m}")


def test_mla_bench_refuses_cleanly_without_cuda():
    """bench/bench_mla.py imports everywhere and, without CUDA, says so and exits 1 (no
    traceback)."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    bench = os.path.join(os.path.dirname(__file__), "..", "bench", "bench_mla.py")
    out = subprocess.run([sys.executable, bench, "--heads", "16,128", "--out", "/dev/null"],
                         capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 1, out.stderr
    assert "no CUDA device here" in out.stderr and "Traceback" not in out.stderr
