"""torch_native attention against a naive dense reference over scattered paged slots."""

from __future__ import annotations

import math

import pytest
import torch
from model_fixtures import PagedHarness

from core.contract.attention import AttentionLayerParams, BackendContext
from plugins.attention.torch_native.backend import TorchNativeAttention

D = 16


def reference(q, k, v, prefix, scale, window=None, softcap=None):
    """One request, dense, fp64: q [n, H, D] at positions prefix.., k/v [L, Hkv, D] from 0."""
    n, H, _ = q.shape
    L, Hkv, _ = k.shape
    k = k.double().repeat_interleave(H // Hkv, dim=1)
    v = v.double().repeat_interleave(H // Hkv, dim=1)
    s = torch.einsum("nhd,lhd->hnl", q.double(), k) * scale
    if softcap:
        s = torch.tanh(s / softcap) * softcap
    pos = torch.arange(prefix, prefix + n).unsqueeze(1)
    j = torch.arange(L).unsqueeze(0)
    visible = j <= pos
    if window:
        visible &= pos - j < window
    s = s.masked_fill(~visible, float("-inf"))
    return torch.einsum("hnl,lhd->nhd", torch.softmax(s, -1), v)


def run_case(heads, kv_heads, page_size, prefix_lens, extend_lens, decode=False, window=None,
             softcap=None, seed=0, max_context=256):
    g = torch.Generator().manual_seed(seed)
    backend = TorchNativeAttention(BackendContext(heads, kv_heads, D, 1, torch.float32,
                                                  torch.float32, torch.device("cpu"),
                                                  page_size, max_context))
    h = PagedHarness(1, kv_heads, D, page_size, num_pages=512 // page_size, backend=backend,
                     seed=seed, max_context=max_context)
    B = len(prefix_lens)
    full = [p + n for p, n in zip(prefix_lens, extend_lens, strict=True)]
    K = [torch.randn(L, kv_heads, D, generator=g) for L in full]
    V = [torch.randn(L, kv_heads, D, generator=g) for L in full]
    # The cached prefix: written straight into the pool at the slots the harness hands out.
    if any(prefix_lens):
        pre = h.batch(list(range(B)), [[0] * p for p in prefix_lens])
        h.pool.set_kv(0, pre.out_cache_loc, torch.cat([k[:p] for k, p in zip(K, prefix_lens,
                                                                               strict=True)]),
                      torch.cat([v[:p] for v, p in zip(V, prefix_lens, strict=True)]))
    batch = h.batch(list(range(B)), [[0] * n for n in extend_lens], decode=decode)
    scale = 1 / math.sqrt(D)
    qs = [3 * torch.randn(n, heads, D, generator=g) for n in extend_lens]  # x3: caps matter
    k_new = torch.cat([k[p:] for k, p in zip(K, prefix_lens, strict=True)])
    v_new = torch.cat([v[p:] for v, p in zip(V, prefix_lens, strict=True)])
    layer = AttentionLayerParams(0, heads, kv_heads, D, scale, sliding_window=window,
                                 logit_softcap=softcap)
    T = sum(extend_lens)
    out = backend.forward(torch.cat(qs).view(T, heads * D), k_new.reshape(T, kv_heads * D),
                          v_new.reshape(T, kv_heads * D), layer, batch)
    assert out.shape == (T, heads * D)
    # the new K/V landed at out_cache_loc
    k_buf, v_buf = h.pool.get_kv_buffer(0)
    torch.testing.assert_close(k_buf[batch.out_cache_loc], k_new)
    torch.testing.assert_close(v_buf[batch.out_cache_loc], v_new)
    want = torch.cat([reference(q, k, v, p, scale, window, softcap)
                      for q, k, v, p in zip(qs, K, V, prefix_lens, strict=True)])
    torch.testing.assert_close(out.double(), want.reshape(T, heads * D), rtol=1e-5, atol=1e-5)
    return h, batch


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 1), (8, 2)])
@pytest.mark.parametrize("page_size", [1, 16])
def test_ragged_extend_with_prefix(heads, kv_heads, page_size):
    run_case(heads, kv_heads, page_size, prefix_lens=[0, 5, 17], extend_lens=[9, 1, 6])


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 1), (8, 2)])
@pytest.mark.parametrize("page_size", [1, 16])
def test_ragged_decode(heads, kv_heads, page_size):
    run_case(heads, kv_heads, page_size, prefix_lens=[3, 20, 11], extend_lens=[1, 1, 1],
             decode=True)


def test_long_causal_prefill_in_query_blocks():
    """A prompt of >= 2 x CAUSAL_BLOCK tokens (no prefix) is attended one query block at a time
    on a CPU; the last block is partial, and a short prompt in the same batch is not blocked."""
    from plugins.attention.torch_native.backend import CAUSAL_BLOCK

    run_case(8, 2, 1, prefix_lens=[0, 0], extend_lens=[2 * CAUSAL_BLOCK + 45, 7],
             max_context=512)


def test_decode_batch_of_one():
    run_case(4, 2, 4, prefix_lens=[13], extend_lens=[1], decode=True)


@pytest.mark.parametrize("decode", [False, True])
@pytest.mark.parametrize("page_size", [1, 16])
def test_sliding_window(decode, page_size):
    ext = [1, 1] if decode else [12, 7]
    run_case(4, 2, page_size, prefix_lens=[9, 30], extend_lens=ext, decode=decode, window=5)
    if not decode:  # a whole prompt longer than the window, nothing cached
        run_case(4, 2, page_size, prefix_lens=[0], extend_lens=[20], window=5)


@pytest.mark.parametrize("decode", [False, True])
def test_logit_softcap(decode):
    ext = [1, 1] if decode else [6, 4]
    run_case(8, 2, 16, prefix_lens=[7, 0 if not decode else 3], extend_lens=ext, decode=decode,
             softcap=2.0)


def test_softcap_with_window():
    run_case(4, 1, 1, prefix_lens=[10], extend_lens=[8], window=3, softcap=1.5)


def test_scattered_slots_are_not_contiguous():
    # The harness really scatters pages: otherwise the paged tests would prove little.
    h, batch = run_case(4, 2, 1, prefix_lens=[0], extend_lens=[32])
    slots = batch.out_cache_loc
    assert not torch.equal(slots.sort().values, slots)
    assert (slots.diff() != 1).any()


def test_window_and_softcap_change_the_result():
    # Guards against a reference that ignores them (then the tests above would be vacuous).
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(6, 2, D, generator=g) * 3 for _ in range(3))
    base = reference(q, k, v, 0, 0.25)
    assert not torch.allclose(base, reference(q, k, v, 0, 0.25, window=2))
    assert not torch.allclose(base, reference(q, k, v, 0, 0.25, softcap=1.0))


def test_half_precision_close_to_fp32():
    torch.manual_seed(0)
    backend = TorchNativeAttention(BackendContext(4, 2, D, 1, torch.bfloat16, torch.bfloat16,
                                                  torch.device("cpu"), 4, 64))
    h = PagedHarness(1, 2, D, 4, backend=backend, dtype=torch.bfloat16)
    batch = h.batch([0], [[0] * 10])
    q, k, v = torch.randn(10, 4 * D), torch.randn(10, 2 * D), torch.randn(10, 2 * D)
    layer = AttentionLayerParams(0, 4, 2, D, D ** -0.5)
    out = backend.forward(q.bfloat16(), k.bfloat16(), v.bfloat16(), layer, batch)
    assert out.dtype == torch.bfloat16
    want = reference(q.view(10, 4, D), k.view(10, 2, D), v.view(10, 2, D), 0, D ** -0.5)
    torch.testing.assert_close(out.double(), want.reshape(10, 4 * D), rtol=0.05, atol=0.05)


@pytest.mark.parametrize("heads,kv_heads,window", [(4, 2, None), (4, 1, 3), (2, 2, None)])
def test_decode_steps_through_the_dense_copy(heads, kv_heads, window):
    # CPU decode carries a dense copy of the batch's K/V across steps (dense_decode.py): it must
    # follow requests leaving, another request's extend, and any other write into the pool.
    g = torch.Generator().manual_seed(1)
    layers = [AttentionLayerParams(i, heads, kv_heads, D, D ** -0.5, sliding_window=window)
              for i in range(2)]
    backend = TorchNativeAttention(BackendContext(heads, kv_heads, D, 2, torch.float32,
                                                  torch.float32, torch.device("cpu"), 1, 256))
    h = PagedHarness(2, kv_heads, D, 1, num_pages=1024, backend=backend, seed=1)
    K = {}  # (row, layer) -> [L, Hkv, D] everything written so far, likewise V
    V = {}

    def step(rows, n_new, decode, expect_continued=None):
        batch = h.batch(rows, [[0] * n for n in n_new], decode=decode)
        if expect_continued is not None:
            assert batch.attn_meta.dense_continued == expect_continued
        T = sum(n_new)
        for layer in layers:
            q = torch.randn(T, heads, D, generator=g)
            k, v = (torch.randn(T, kv_heads, D, generator=g) for _ in range(2))
            out = backend.forward(q.view(T, -1), k.view(T, -1), v.view(T, -1), layer, batch)
            t, want = 0, []
            for r, n in zip(rows, n_new, strict=True):
                key = (r, layer.layer_id)
                K[key] = torch.cat([K.get(key, k[:0]), k[t:t + n]])
                V[key] = torch.cat([V.get(key, v[:0]), v[t:t + n]])
                want.append(reference(q[t:t + n], K[key], V[key], len(K[key]) - n,
                                      D ** -0.5, window))
                t += n
            torch.testing.assert_close(out.double(), torch.cat(want).reshape(T, -1),
                                       rtol=1e-5, atol=1e-5)

    step([0, 1, 2], [5, 9, 3], decode=False)
    step([0, 1, 2], [1, 1, 1], decode=True, expect_continued=False)  # first decode: built
    for _ in range(3):
        step([0, 1, 2], [1, 1, 1], decode=True, expect_continued=True)
    step([0, 2], [1, 1], decode=True, expect_continued=False)  # row 1 left: rebuilt
    step([0, 2], [1, 1], decode=True, expect_continued=True)
    step([3], [4], decode=False)  # another request's extend writes the pool
    step([0, 2], [1, 1], decode=True, expect_continued=True)  # rows continue, layers rebuilt
    step([0, 2], [1, 1], decode=True, expect_continued=True)
    # Any other write into slots the copy holds (here: row 0's first tokens) is seen: a writer
    # outside a forward step begins one (KVPool.step), as the model runner does.
    slots = h.req_to_token[0, :3].long()
    h.pool.begin_step()
    for layer in layers:
        k, v = (torch.randn(3, kv_heads, D, generator=g) for _ in range(2))
        h.pool.set_kv(layer.layer_id, slots, k, v)
        K[(0, layer.layer_id)][:3], V[(0, layer.layer_id)][:3] = k, v
    step([0, 2], [1, 1], decode=True, expect_continued=True)
    step([2], [1], decode=True, expect_continued=False)  # batch of one
    step([2], [1], decode=True, expect_continued=True)
