"""Which conformance cases a backend gets: the matrix, cut to what its capabilities declare.

Axes: decode and extend; GQA ratios 1, 4, 8; head dims 64 and 128 plus every other size the
backend declares; page sizes 1, 16, 64 (those it accepts, else the ones it declares); each compute
dtype it declares; and, where declared, sliding windows, logit soft-cap, FP8 KV caches, and a
multi-layer step. Batches are ragged: fresh requests, one-token extensions, prefixes that end on
and off page boundaries.

Small cases (the default) keep CPU runs, the Triton interpreter included, to seconds per backend:
(GQA ratio x page size) is covered in full and head dims / dtypes rotate through it. Full cases
(`--conformance-full`, meant for an accelerator) use real context lengths and the full
(GQA ratio x page size x head dim) product.
"""

from __future__ import annotations

import itertools

from core.capabilities import AttentionCaps
from core.testing.paged_batch import FP8, AttentionCase

GROUPS = (1, 4, 8)
HEAD_DIMS = (64, 128)
PAGE_SIZES = (1, 16, 64)
DTYPES = ("float16", "bfloat16", "float32")

# Requests as (prefix, new tokens). Decode: new = 1.
_SMALL_DECODE = ((0, 1), (16, 1), (68, 1), (129, 1))
_SMALL_EXTEND = ((0, 9), (5, 1), (31, 17), (64, 40))
_FULL_DECODE = tuple((n - 1, 1) for n in (1, 2, 65, 127, 511, 1025, 2047, 3000, 4096, 4097,
                                           8191, 8192))
_FULL_EXTEND = ((0, 1), (0, 517), (1, 1), (127, 64), (1024, 1024), (2000, 333), (4096, 129),
                (0, 2048))
# Small cases keep few heads (interpreter time grows with heads); full ones are model-like.
_SMALL_KV_HEADS = {1: 2, 4: 2, 8: 1}
_FULL_KV_HEADS = {1: 8, 4: 8, 8: 4}


def backend_dtypes(caps: AttentionCaps, exclude: tuple[str, ...] = ()) -> list[str]:
    return [d for d in DTYPES if d in caps.dtypes and d not in exclude]


def backend_page_sizes(caps: AttentionCaps) -> list[int]:
    sizes = [p for p in PAGE_SIZES if caps.page_sizes.accepts(p)]
    if caps.page_sizes.mode == "set":
        sizes += [p for p in caps.page_sizes.values if p not in sizes]
    return sizes or [caps.page_sizes.preferred()]


def backend_head_dims(caps: AttentionCaps) -> tuple[list[int], list[int]]:
    """(the standard dims it takes, the other dims it declares)."""
    if caps.head_sizes is None:
        return list(HEAD_DIMS), []
    return ([d for d in HEAD_DIMS if d in caps.head_sizes],
            sorted(d for d in caps.head_sizes if d not in HEAD_DIMS))


def _windows(requests: tuple[tuple[int, int], ...]) -> tuple[int, int]:
    """A window shorter than a page and one that spans a few, both shorter than the longest
    request, so that keys really fall out of view."""
    longest = max(p + n for p, n in requests)
    return max(2, min(7, longest // 4)), max(3, min(longest // 2, 1000))


def conformance_cases(caps: AttentionCaps, full: bool = False,
                      exclude_dtypes: tuple[str, ...] = ()) -> list[AttentionCase]:
    """Every case `caps` qualifies for (none for an axis it declares nothing on)."""
    dtypes = backend_dtypes(caps, exclude_dtypes)
    pages = backend_page_sizes(caps)
    dims, other_dims = backend_head_dims(caps)
    groups = [g for g in GROUPS if (("MHA" if g == 1 else "GQA") in caps.attention_kinds)]
    if not dtypes or not groups or not (dims or other_dims):
        return []
    dims = dims or other_dims[:1]
    kv_heads = _FULL_KV_HEADS if full else _SMALL_KV_HEADS
    cases: list[AttentionCase] = []
    for mode in ("decode", "extend"):
        if ("decode" if mode == "decode" else "prefill") not in caps.phases:
            continue
        if mode == "decode":
            requests = _FULL_DECODE if full else _SMALL_DECODE
        else:
            requests = _FULL_EXTEND if full else _SMALL_EXTEND
        seqs = tuple(p + n for p, n in requests)
        news = tuple(n for _, n in requests)

        def case(group: int, dim: int, page: int, dtype: str, kv_dtype: str | None = None,
                 _mode=mode, _seqs=seqs, _news=news, **features) -> AttentionCase:
            return AttentionCase(_mode, kv_heads[group], group, dim, page, dtype,
                                 kv_dtype or dtype, _seqs, _news, **features)

        combos = list(itertools.product(groups, pages, dims if full else [None]))
        for i, (group, page, dim) in enumerate(combos):
            cases.append(case(group, dim or dims[i % len(dims)], page, dtypes[i % len(dtypes)]))
        # Declared head sizes beyond 64/128, dtypes rotating (GQA when declared).
        mid_group = 4 if 4 in groups else groups[0]
        for i, dim in enumerate(other_dims):
            cases.append(case(mid_group, dim, pages[i % len(pages)], dtypes[i % len(dtypes)]))
        page = pages[-1]
        dim = dims[-1]
        dtype = dtypes[0]
        if caps.sliding_window:
            small_w, big_w = _windows(requests)
            cases.append(case(mid_group, dim, pages[0], dtype, sliding_window=small_w))
            cases.append(case(groups[-1], dims[0], page, dtypes[-1], sliding_window=big_w))
        if caps.logit_softcap:
            cases.append(case(mid_group, dim, page, dtype, logit_softcap=5.0))
        if caps.sliding_window and caps.logit_softcap:
            cases.append(case(groups[-1], dim, pages[0], dtypes[-1],
                              sliding_window=_windows(requests)[1], logit_softcap=8.0))
        for kv in FP8:
            if kv in caps.kv_cache_dtypes:
                for j, kv_compute in enumerate([d for d in dtypes if d != "float32"] or dtypes):
                    if full or j == 0:
                        cases.append(case(mid_group, dim, page, kv_compute, kv_dtype=kv))
        cases.append(case(groups[0], dims[0], page, dtype, layers=2))
    return cases
