"""The MLA attention conformance tests (core.contract.mla).

Collected by the conformance plugin (`pytest --conformance-mla NAME`), or by importing them:

    from conformance.mla_suite import *  # noqa: F401,F403

Parametrized over every registered attention backend that declares the "MLA" kind and can run on
each suite device (or those named with --conformance-mla), over its declared compute dtypes
(fp32, fp16, bf16; the latent pool in the same dtype, which the backend must declare as a cache
dtype) and page sizes (1, 16, 64 where accepted). fp32 runs every page size; fp16 and bf16 one
(16 where accepted), every page size with --conformance-full. One case: two requests in one
extend batch (one over a cached prefix of whole pages, one from scratch), then a decode batch of
both, against a reference computed here in fp64 from the same dtype-rounded inputs, in both
forms (materialised: K and V expanded per head from the latent; absorbed: q_nope through w_kc,
attention over the latent, out through w_vc), which must agree with each other; tolerances are
the attention suite's per compute dtype. The backend must write each new token's
[latent | k_rope] row at its slot (exactly) and nothing else. A named backend gets a skipped
`not-covered` param for each declared dtype the suite leaves out here (bf16 under the Triton
interpreter).
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from conformance.attention_check import TOLERANCES, excluded_dtype_reasons
from conformance.suite_kit import Target, skip_param, suite_params
from core.contract.attention import BackendContext
from core.contract.forward_batch import ForwardBatch, ForwardMode
from core.contract.mla import MLALayerParams, MLAWeights
from core.plan.registry import Registration

__all__ = ["pytest_generate_tests", "test_mla_backend_conformance", "mla_reference"]
# also importable: MLAParam, check_mla_case (one case on one backend, for backend-specific tests)

# (heads, kv_lora_rank, qk_nope, qk_rope, v): small, and DeepSeek's real head (latent 576)
SHAPES = ((4, 64, 32, 16, 24), (2, 512, 128, 64, 128))
PAGE_SIZES = (1, 16, 64)
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
HALF_PAGE = 16  # the page size fp16 / bf16 run at (without --conformance-full), when accepted


@dataclass(frozen=True)
class MLAParam:
    backend: Registration
    device: str
    page_size: int
    shape: tuple[int, int, int, int, int]
    dtype: str = "float32"


def mla_reference(q_nope: torch.Tensor, q_rope: torch.Tensor, rows: torch.Tensor,
                  w: MLAWeights, layer: MLALayerParams, absorbed: bool) -> torch.Tensor:
    """fp32 MLA of the last n of S tokens: q_nope [n, H, Dn], q_rope [n, H, Dr], rows [S, R + Dr]
    -> [n, H, Dv], causal; in the materialised or the absorbed form."""
    R = layer.kv_lora_rank
    c, kr = rows[:, :R].double(), rows[:, R:].double()
    w_kc, w_vc = w.w_kc.double(), w.w_vc.double()
    qn, qr = q_nope.double(), q_rope.double()
    n, S = qn.shape[0], rows.shape[0]
    if absorbed:
        scores = torch.einsum("nhr,sr->hns", torch.einsum("nhd,hdr->nhr", qn, w_kc), c)
    else:
        scores = torch.einsum("nhd,hsd->hns", qn, torch.einsum("sr,hdr->hsd", c, w_kc))
    scores = (scores + torch.einsum("nhd,sd->hns", qr, kr)) * layer.scaling
    visible = torch.arange(S)[None, :] <= torch.arange(S - n, S)[:, None]
    p = scores.masked_fill(~visible.to(scores.device), float("-inf")).softmax(-1)
    if absorbed:
        out = torch.einsum("nhr,hdr->nhd", torch.einsum("hns,sr->nhr", p, c), w_vc)
    else:
        out = torch.einsum("hns,hsd->nhd", p, torch.einsum("sr,hdr->hsd", c, w_vc))
    return out.float()


def mla_params(config: pytest.Config) -> list:
    def declines(reg: Registration) -> str | None:
        if "MLA" not in reg.caps.attention_kinds:
            return f"{reg.name} declares no MLA"
        return None

    def cases(t: Target) -> list:
        caps, params = t.reg.caps, []
        excluded = excluded_dtype_reasons(t.reg, t.device)
        dtypes = [d for d in DTYPES if d in caps.dtypes and d in caps.kv_cache_dtypes
                  and d not in excluded]
        pages = [p for p in PAGE_SIZES if caps.page_sizes.accepts(p)]
        for dtype in dtypes:
            run_pages = pages
            if dtype != "float32" and not t.full:
                run_pages = [HALF_PAGE] if HALF_PAGE in pages else pages[:1]
            for page in run_pages:
                for shape in SHAPES:
                    latent = shape[1] + shape[3]
                    if caps.head_sizes is not None and latent not in caps.head_sizes:
                        continue
                    suffix = "" if dtype == "float32" else f"-{dtype}"
                    params.append(pytest.param(
                        MLAParam(t.reg, t.device_name, page, shape, dtype),
                        id=f"{t.name}-{t.device_name}-p{page}-latent{latent}{suffix}",
                        marks=t.marks))
        if t.named:  # asked for by name: say what is not tested, and why
            params += [skip_param(f"{t.name}-{t.device_name}-not-covered-{d}", reason, t.marks)
                       for d, reason in excluded.items() if d in caps.dtypes]
        return params

    params = suite_params(config, "attention", "conformance_mla", "MLA attention backend", cases,
                          say_device=False, declines=declines)
    if not params:
        params.append(pytest.param(None, id="no-mla-backend", marks=pytest.mark.skip(
            reason="no selected attention backend declares MLA on a selected device")))
    return params


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "mla_conformance" in metafunc.fixturenames:
        metafunc.parametrize("mla_conformance", mla_params(metafunc.config))


def test_mla_backend_conformance(mla_conformance: MLAParam) -> None:
    check_mla_case(mla_conformance)


def check_mla_case(p: MLAParam) -> None:
    """Run the suite's case on p.backend (see the module doc); AssertionError on a mismatch."""
    from core.engine.memory.kv_cache import MLAKVPool

    H, R, Dn, Dr, Dv = p.shape
    device, page = torch.device(p.device), p.page_size
    dtype = DTYPES[p.dtype]
    atol, rtol = TOLERANCES[p.dtype]
    g = torch.Generator().manual_seed(0)
    layer = MLALayerParams(layer_id=1, num_heads=H, kv_lora_rank=R, qk_nope_head_dim=Dn,
                           qk_rope_head_dim=Dr, v_head_dim=Dv, scaling=(Dn + Dr) ** -0.5 * 1.2)
    kv_b = (torch.randn(H * (Dn + Dv), R, generator=g) / R ** 0.5).to(device, dtype)
    w = MLAWeights.split(kv_b, H, Dn)
    backend = p.backend.load()(BackendContext(
        num_heads=H, num_kv_heads=1, head_dim=Dn + Dr, num_layers=2, dtype=dtype,
        kv_dtype=dtype, device=device, page_size=page, max_context_len=256))
    pages = 64 // page + 8
    pool = MLAKVPool(pages * page, 2, R, Dr, dtype, device, page)
    for buf in pool.latent_buffers:
        buf.copy_(torch.randn(buf.shape, generator=g))
    # request 0: 2 pages cached, 7 new tokens; request 1: 13 new; then one decode token each
    cached, new, total = [2 * page, 0], [7, 13], [2 * page + 8, 14]
    free = (torch.randperm(pages - 1, generator=g) + 1).tolist()
    table = torch.zeros(2, 256, dtype=torch.int32)
    for r in (0, 1):
        n_pages = -(-total[r] // page)
        slots = [pg * page + o for pg in (free.pop() for _ in range(n_pages)) for o in range(page)]
        table[r, :len(slots)] = torch.tensor(slots, dtype=torch.int32)
    table = table.to(device)
    # drawn in fp32 (the same numbers for every dtype), then rounded to the dtype: the reference
    # computes from the rounded values, so only the backend's arithmetic is measured
    rows = {r: torch.randn(total[r], R + Dr, generator=g).to(device, dtype) for r in (0, 1)}
    q_n = {r: torch.randn(total[r], H, Dn, generator=g).to(device, dtype) for r in (0, 1)}
    q_r = {r: torch.randn(total[r], H, Dr, generator=g).to(device, dtype) for r in (0, 1)}
    buf = pool.latent_buffers[1]
    buf[table[0, :cached[0]].long()] = rows[0][:cached[0]]  # the cached prefix

    for prefix, n, mode in ((cached, new, ForwardMode.EXTEND),
                            ([c + k for c, k in zip(cached, new, strict=True)], [1, 1],
                             ForwardMode.DECODE)):
        seq = [a + b for a, b in zip(prefix, n, strict=True)]
        loc = torch.cat([table[r, prefix[r]:seq[r]].long() for r in (0, 1)])
        batch = ForwardBatch(
            mode=mode, input_ids=torch.zeros(len(loc), dtype=torch.int64, device=device),
            positions=torch.cat([torch.arange(prefix[r], seq[r]) for r in (0, 1)]).to(device),
            seq_lens=torch.tensor(seq, dtype=torch.int32, device=device),
            prefix_lens=torch.tensor(prefix, dtype=torch.int32, device=device),
            extend_lens=torch.tensor(n, dtype=torch.int32, device=device), out_cache_loc=loc,
            req_pool_indices=torch.tensor([0, 1], device=device), req_to_token=table,
            kv_pool=pool, seq_lens_cpu=seq, prefix_lens_cpu=list(prefix), extend_lens_cpu=n,
            attn_backend=backend)
        pool.begin_step()
        batch.attn_meta = backend.prepare(batch)
        before = [b.clone() for b in pool.latent_buffers]
        lat, qn, qr = (torch.cat([d[r][prefix[r]:seq[r]] for r in (0, 1)])
                       for d in (rows, q_n, q_r))
        out = backend.forward_mla(qn, qr, lat[:, :R], lat[:, R:], w, layer, batch)
        assert out.shape == (len(loc), H * Dv) and out.dtype == dtype
        assert bool(torch.isfinite(out).all()), f"{mode.value}: non-finite output"
        # the new rows at their slots, nothing else in the pool
        want_pool = before[1].clone()
        want_pool[loc] = lat
        torch.testing.assert_close(pool.latent_buffers[1], want_pool, rtol=0, atol=0)
        torch.testing.assert_close(pool.latent_buffers[0], before[0], rtol=0, atol=0)
        start = 0
        for r in (0, 1):
            args = (q_n[r][:seq[r]][prefix[r]:], q_r[r][:seq[r]][prefix[r]:], rows[r][:seq[r]],
                    w, layer)
            mat, absorbed = mla_reference(*args, absorbed=False), mla_reference(*args,
                                                                                absorbed=True)
            torch.testing.assert_close(absorbed, mat, rtol=1e-5, atol=1e-5)
            got = out[start:start + n[r]].view(n[r], H, Dv).float()
            torch.testing.assert_close(got, mat, rtol=rtol, atol=atol,
                                       msg=lambda m, r=r, mode=mode: f"{mode.value} r{r}: {m}")
            start += n[r]
