"""The MLA kind (core.contract.mla) on its reference backend, torch_native_mla, in fp32: the
absorbed form equals the materialised one on random data, and the backend over a paged latent
pool (scattered pages, a chunked extend, a shared prefix, decode steps) equals one dense
materialised attention over the whole sequence."""

from __future__ import annotations

import pytest
import torch

from core.contract.attention import BackendContext
from core.contract.capabilities import c_compiler
from core.contract.forward_batch import ForwardBatch, ForwardMode
from core.contract.mla import MLALayerParams, MLAWeights
from core.engine.memory.kv_cache import KVPool, MLAKVPool
from plugins._kit.mla_torch import mla_absorbed, mla_materialised
from plugins.attention.torch_native_mla.backend import TorchNativeMLA

H, DN, DR, DV, R = 4, 16, 8, 12, 32
LAYER = MLALayerParams(layer_id=0, num_heads=H, kv_lora_rank=R, qk_nope_head_dim=DN,
                       qk_rope_head_dim=DR, v_head_dim=DV, scaling=(DN + DR) ** -0.5 * 1.3)


def _weights(g: torch.Generator) -> MLAWeights:
    kv_b = torch.randn(H * (DN + DV), R, generator=g) / R ** 0.5
    return MLAWeights.split(kv_b, H, DN)


@pytest.mark.parametrize("n,s", [(1, 1), (1, 37), (5, 5), (7, 20)])
def test_absorbed_equals_materialised(n, s):
    g = torch.Generator().manual_seed(n * 100 + s)
    w = _weights(g)
    q_nope, q_rope = torch.randn(n, H, DN, generator=g), torch.randn(n, H, DR, generator=g)
    cache = torch.randn(s, R + DR, generator=g)
    a = mla_absorbed(q_nope, q_rope, cache, w, LAYER)
    m = mla_materialised(q_nope, q_rope, cache, w, LAYER)
    assert a.shape == (n, H, DV)
    torch.testing.assert_close(a, m, rtol=1e-5, atol=1e-5)


def test_kv_b_proj_split_is_per_head_nope_then_v():
    w = torch.arange(H * (DN + DV) * 2, dtype=torch.float32).view(H * (DN + DV), 2)
    split = MLAWeights.split(w, H, DN)
    assert split.w_kc.shape == (H, DN, 2) and split.w_vc.shape == (H, DV, 2)
    torch.testing.assert_close(split.w_kc[1, 0], w[DN + DV])
    torch.testing.assert_close(split.w_vc[1, 0], w[DN + DV + DN])


def test_latent_pool_bytes():
    # DeepSeek-V2-Lite: 27 layers, 512 + 64 latent values against 16 heads of K (192) + V (128)
    latent = MLAKVPool.bytes_per_token(27, 512, 64, torch.bfloat16)
    full = KVPool.bytes_per_token(27, 16, 192, torch.bfloat16, v_head_dim=128)
    assert latent == 27 * 576 * 2 and full == 27 * 16 * 320 * 2
    assert full / latent == pytest.approx(8.89, abs=0.01)


def _batch(pool, table, rows, prefix, new, decode, backend):
    locs, pos = [], []
    for r, p, n in zip(rows, prefix, new, strict=True):
        locs += table[r, p:p + n].tolist()
        pos += list(range(p, p + n))
    seq = [p + n for p, n in zip(prefix, new, strict=True)]
    fb = ForwardBatch(
        mode=ForwardMode.DECODE if decode else ForwardMode.EXTEND,
        input_ids=torch.zeros(len(locs), dtype=torch.int64),
        positions=torch.tensor(pos), seq_lens=torch.tensor(seq, dtype=torch.int32),
        prefix_lens=torch.tensor(prefix, dtype=torch.int32),
        extend_lens=torch.tensor(new, dtype=torch.int32),
        out_cache_loc=torch.tensor(locs, dtype=torch.int64),
        req_pool_indices=torch.tensor(rows, dtype=torch.int64), req_to_token=table,
        kv_pool=pool, seq_lens_cpu=seq, prefix_lens_cpu=list(prefix), extend_lens_cpu=list(new),
        attn_backend=backend)
    pool.begin_step()
    fb.attn_meta = backend.prepare(fb)
    return fb


def _cpu_c_mla():
    if c_compiler() is None:
        pytest.skip("cpu_c_mla builds its kernel with a C compiler; none on PATH")
    from plugins.attention.cpu_c.mla import CpuCMLA
    return CpuCMLA


@pytest.mark.parametrize("which,dtype", [("torch_native_mla", torch.float32),
                                         ("cpu_c_mla", torch.float32),
                                         ("cpu_c_mla", torch.bfloat16)])
def test_backend_over_paged_latent_pool_matches_dense(which, dtype):
    """Two requests: A prefilled in two chunks then decoded; B shares A's first 8 tokens
    (pages) and extends past them, then decodes with A in one batch. In bf16 (pool, inputs,
    weights) against the fp32 reference on the same rounded values."""
    g = torch.Generator().manual_seed(0)
    page, n_pages = 4, 32
    pool = MLAKVPool(page * n_pages, 1, R, DR, dtype, "cpu", page)
    cls = TorchNativeMLA if which == "torch_native_mla" else _cpu_c_mla()
    backend = cls(BackendContext(
        num_heads=H, num_kv_heads=1, head_dim=DN + DR, num_layers=1, dtype=dtype,
        kv_dtype=dtype, device=torch.device("cpu"), page_size=page, max_context_len=64))
    w = _weights(g)
    w = MLAWeights(w.w_kc.to(dtype), w.w_vc.to(dtype))
    total = {0: 14, 1: 13}

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(dtype)
    q_n = {r: rand(n, H, DN) for r, n in total.items()}
    q_r = {r: rand(n, H, DR) for r, n in total.items()}
    lat = {r: rand(n, R) for r, n in total.items()}
    kr = {r: rand(n, DR) for r, n in total.items()}
    lat[1][:8], kr[1][:8] = lat[0][:8], kr[0][:8]  # B's prefix is A's
    table = torch.zeros(2, 64, dtype=torch.int32)
    pages = (torch.randperm(n_pages - 1, generator=g) + 1).tolist()
    for r in (0, 1):
        own = [pages.pop() for _ in range(4)]
        if r == 1:
            own[:2] = table[0, 0:8:page].div(page, rounding_mode="floor").tolist()
        table[r, :16] = torch.tensor([p * page + o for p in own for o in range(page)])
    got = {0: [], 1: []}

    def step(rows, prefix, new, decode):
        fb = _batch(pool, table, rows, prefix, new, decode, backend)
        sl = [slice(p, p + n) for p, n in zip(prefix, new, strict=True)]
        cat = lambda d: torch.cat([d[r][s] for r, s in zip(rows, sl, strict=True)])  # noqa: E731
        out = backend.forward_mla(cat(q_n), cat(q_r), cat(lat), cat(kr), w, LAYER, fb)
        start = 0
        for r, n in zip(rows, new, strict=True):
            got[r].append(out[start:start + n])
            start += n

    step([0], [0], [5], False)  # A: first chunk
    step([0], [5], [7], False)  # A: second chunk over its cached prefix
    step([1], [8], [4], False)  # B: extends past the shared 8-token prefix
    step([0, 1], [12, 12], [1, 1], True)  # decode, both
    step([0], [13], [1], True)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for r, n_got in ((0, 14), (1, 5)):
        out = torch.cat(got[r]).view(n_got, H, DV)
        assert out.dtype == dtype
        n_all = total[r]
        cache = torch.cat([lat[r], kr[r]], dim=1)
        want = mla_materialised(q_n[r], q_r[r], cache, w, LAYER).view(n_all, H, DV)
        torch.testing.assert_close(out.float(), want[n_all - n_got:], rtol=tol, atol=tol)


@pytest.mark.parametrize("heads,r,dr,threads", [(5, 20, 6, 2), (16, 512, 64, 2), (3, 64, 16, 1),
                                                (128, 64, 16, 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_c_mla_decode_odd_shapes(heads, r, dr, threads, dtype):
    """cpu_c_mla's decode kernel (row tiles of 32, 2-head x 4-row score blocks, 2-head value
    blocks, padding to the vector width) against the absorbed reference: odd head counts and
    latent widths, contexts shorter than, equal to and spanning several tiles, in one batch;
    head counts split over threads (batch 1 at 2-3 threads) and not."""
    cls = _cpu_c_mla()
    g = torch.Generator().manual_seed(heads * 1000 + r)
    dn, dv = 8, 12
    layer = MLALayerParams(layer_id=0, num_heads=heads, kv_lora_rank=r, qk_nope_head_dim=dn,
                           qk_rope_head_dim=dr, v_head_dim=dv, scaling=0.3)
    w = MLAWeights.split((torch.randn(heads * (dn + dv), r, generator=g) / r ** 0.5).to(dtype),
                         heads, dn)
    lens = [1, 32, 70] if threads != 1 else [45]
    page = 8
    slots_per = [(-(-n // page)) * page for n in lens]
    pool = MLAKVPool(sum(slots_per) + 4 * page, 1, r, dr, dtype, "cpu", page)
    pool.latent_buffers[0].copy_(torch.randn(pool.latent_buffers[0].shape, generator=g))
    perm = (torch.randperm(pool.num_slots // page - 1, generator=g) + 1).tolist()
    table = torch.zeros(len(lens), max(slots_per), dtype=torch.int32)
    for b, n in enumerate(slots_per):
        table[b, :n] = torch.cat([torch.arange(page) + perm.pop() * page
                                  for _ in range(n // page)])
    backend = cls(BackendContext(num_heads=heads, num_kv_heads=1, head_dim=dn + dr,
                                 num_layers=1, dtype=dtype, kv_dtype=dtype,
                                 device=torch.device("cpu"), page_size=page,
                                 max_context_len=128))
    backend.threads = threads
    B = len(lens)
    fb = _batch(pool, table, list(range(B)), [n - 1 for n in lens], [1] * B, True, backend)
    q_nope = torch.randn(B, heads, dn, generator=g).to(dtype)
    q_rope = torch.randn(B, heads, dr, generator=g).to(dtype)
    lat = torch.randn(B, r, generator=g).to(dtype)
    kr = torch.randn(B, dr, generator=g).to(dtype)
    out = backend.forward_mla(q_nope, q_rope, lat, kr, w, layer, fb).view(B, heads, dv)
    buf = pool.latent_buffers[0]
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for b, n in enumerate(lens):
        rows = buf[table[b, :n].long()]
        want = mla_absorbed(q_nope[b:b + 1], q_rope[b:b + 1], rows, w, layer)[0]
        torch.testing.assert_close(out[b].float(), want, rtol=tol, atol=tol)
