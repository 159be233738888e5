"""Which conformance cases a backend gets: the matrix, cut to what its capabilities declare.

Axes: decode and extend; GQA ratios 1, 4, 8 (as MHA, GQA or MQA shapes, whichever kinds the
backend declares); head dims 64 and 128 plus every other size the backend declares; page sizes 1,
16, 64 (those it accepts, else the ones it declares); each compute dtype it declares (with a KV
cache of that dtype, where declared too); and, where declared, sliding windows, logit soft-cap,
attention sinks, FP8 KV caches, and a multi-layer step. Batches are ragged: fresh requests, one-token extensions,
prefixes that end on and off page boundaries.

What a backend does not declare is not run; `not_covered` names it (and what the suite cannot
check even when declared), so that the suite can list it as skipped with the reason.

Small cases (the default) keep CPU runs, the Triton interpreter included, to seconds per backend:
(GQA ratio x page size) is covered in full and head dims / dtypes rotate through it. Full cases
(`--conformance-full`, meant for an accelerator) use real context lengths and the full
(GQA ratio x page size x head dim) product.
"""

from __future__ import annotations

import itertools

from conformance.paged_batch import FP8, AttentionCase, attention_kind
from core.contract.capabilities import AttentionCaps

GROUPS = (1, 4, 8)
HEAD_DIMS = (64, 128)
PAGE_SIZES = (1, 16, 64)
DTYPES = ("float16", "bfloat16", "float32")

# Requests as (prefix, new tokens). Decode: new = 1.
_SMALL_DECODE = ((0, 1), (16, 1), (68, 1), (129, 1))
_SMALL_EXTEND = ((0, 9), (5, 1), (31, 17), (64, 40))
# A speculative verify step: each request's last token and a few drafts over its cached prefix
# (at most 8 new tokens a request: a backend may run such extends as decode rows).
_VERIFY_EXTEND = ((12, 5), (0, 3), (40, 8), (7, 1))
_FULL_DECODE = tuple((n - 1, 1) for n in (1, 2, 65, 127, 511, 1025, 2047, 3000, 4096, 4097,
                                           8191, 8192))
_FULL_EXTEND = ((0, 1), (0, 517), (1, 1), (127, 64), (1024, 1024), (2000, 333), (4096, 129),
                (0, 2048))
# Small cases keep few heads (interpreter time grows with heads); full ones are model-like.
_SMALL_KV_HEADS = {1: 2, 4: 2, 8: 1}
_FULL_KV_HEADS = {1: 8, 4: 8, 8: 4}


def backend_dtypes(caps: AttentionCaps, exclude: tuple[str, ...] = ()) -> list[str]:
    """Compute dtypes to run with a KV cache of the same dtype (both must be declared)."""
    return [d for d in DTYPES
            if d in caps.dtypes and d in caps.kv_cache_dtypes and d not in exclude]


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


def backend_shapes(caps: AttentionCaps, full: bool = False) -> list[tuple[int, int]]:
    """(GQA ratio, KV heads) per ratio in GROUPS whose kind (attention_kind) is declared.

    A ratio > 1 is GQA with the table's KV heads, or MQA with one (small cases make ratio 8 MQA,
    full ones GQA); when only the other kind is declared, the ratio runs as that kind.
    """
    table = _FULL_KV_HEADS if full else _SMALL_KV_HEADS
    shapes = []
    for group in GROUPS:
        options = [table[group]] if group == 1 else [table[group], 1 if table[group] > 1 else 2]
        for kv_heads in options:
            if attention_kind(kv_heads, group) in caps.attention_kinds:
                shapes.append((group, kv_heads))
                break
    return shapes


def _extra_mqa(caps: AttentionCaps, shapes: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """An MQA shape when MQA is declared and no ratio above ran as MQA (full cases)."""
    if "MQA" in caps.attention_kinds and all(attention_kind(kv, g) != "MQA" for g, kv in shapes):
        return [(GROUPS[-1], 1)]
    return []


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
    shapes = backend_shapes(caps, full)
    if not dtypes or not shapes or not (dims or other_dims):
        return []
    dims = dims or other_dims[:1]
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

        def case(shape: tuple[int, int], dim: int, page: int, dtype: str,
                 kv_dtype: str | None = None, _mode=mode, _seqs=seqs, _news=news,
                 **features) -> AttentionCase:
            group, kv_heads = shape
            return AttentionCase(_mode, kv_heads, group, dim, page, dtype, kv_dtype or dtype,
                                 _seqs, _news, **features)

        combos = list(itertools.product(shapes + _extra_mqa(caps, shapes), pages,
                                        dims if full else [None]))
        for i, (shape, page, dim) in enumerate(combos):
            cases.append(case(shape, dim or dims[i % len(dims)], page, dtypes[i % len(dtypes)]))
        # Declared head sizes beyond 64/128, dtypes rotating (GQA when declared).
        mid = next((sh for sh in shapes if sh[0] == 4), shapes[0])
        for i, dim in enumerate(other_dims):
            cases.append(case(mid, dim, pages[i % len(pages)], dtypes[i % len(dtypes)]))
        page = pages[-1]
        dim = dims[-1]
        dtype = dtypes[0]
        if caps.sliding_window:
            small_w, big_w = _windows(requests)
            cases.append(case(mid, dim, pages[0], dtype, sliding_window=small_w))
            cases.append(case(shapes[-1], dims[0], page, dtypes[-1], sliding_window=big_w))
        if caps.logit_softcap:
            cases.append(case(mid, dim, page, dtype, logit_softcap=5.0))
        if caps.sliding_window and caps.logit_softcap:
            cases.append(case(shapes[-1], dim, pages[0], dtypes[-1],
                              sliding_window=_windows(requests)[1], logit_softcap=8.0))
        if caps.sinks:
            cases.append(case(mid, dim, page, dtype, sinks=True))
            if caps.sliding_window:  # GPT-OSS: sinks on its windowed layers too
                cases.append(case(shapes[-1], dims[0], pages[0], dtypes[-1],
                                  sliding_window=_windows(requests)[0], sinks=True))
        for kv in FP8:
            if kv in caps.kv_cache_dtypes:
                compute = [d for d in DTYPES if d in caps.dtypes and d not in exclude_dtypes]
                for j, kv_compute in enumerate([d for d in compute if d != "float32"]
                                               or compute):
                    if full or j == 0:
                        cases.append(case(mid, dim, page, kv_compute, kv_dtype=kv))
        cases.append(case(shapes[0], dims[0], page, dtype, layers=2))
        if mode == "extend":  # a verify-shaped extend, windowed and soft-capped where declared
            vseqs = tuple(p + n for p, n in _VERIFY_EXTEND)
            vnews = tuple(n for _, n in _VERIFY_EXTEND)
            features = {"sliding_window": 6} if caps.sliding_window else {}
            if caps.logit_softcap:
                features["logit_softcap"] = 5.0
            cases.append(case(mid, dim, pages[0], dtypes[-1], _seqs=vseqs, _news=vnews,
                              tag="verify"))
            if features:
                cases.append(case(mid, dim, page, dtype, _seqs=vseqs, _news=vnews,
                                  tag="verify", **features))
    if caps.verify_rows and "decode" in caps.phases:
        # the verify-shaped requests as decode rows: every row's K/V is new (poisoned until
        # stored), so a row that attends before the others' K/V are stored reads NaN
        vseqs = tuple(p + n for p, n in _VERIFY_EXTEND)
        vnews = tuple(n for _, n in _VERIFY_EXTEND)
        mid = next((sh for sh in shapes if sh[0] == 4), shapes[0])
        for i, page in enumerate(pages):
            cases.append(AttentionCase("verify_rows", mid[1], mid[0], dims[i % len(dims)], page,
                                       dtypes[i % len(dtypes)], dtypes[i % len(dtypes)],
                                       vseqs, vnews))
        features = {"sliding_window": 6} if caps.sliding_window else {}
        if caps.logit_softcap:
            features["logit_softcap"] = 5.0
        if caps.sinks:
            features["sinks"] = True
        if features:
            cases.append(AttentionCase("verify_rows", shapes[-1][1], shapes[-1][0], dims[0],
                                       pages[0], dtypes[-1], dtypes[-1], vseqs, vnews,
                                       **features))
    return cases


def not_covered(caps: AttentionCaps,
                excluded: dict[str, str] | None = None) -> list[tuple[str, str]]:
    """(key, reason) for each axis value the suite covers that `caps` does not declare, each
    declared thing the suite cannot check, and each dtype `excluded` here (dtype -> why)."""
    excluded = excluded or {}
    out: list[tuple[str, str]] = []

    def declared(values) -> str:
        return ", ".join(sorted(map(str, values))) or "none"

    for dtype in DTYPES:
        if dtype not in caps.dtypes:
            out.append((f"dtype-{dtype}", f"compute dtype {dtype} not declared "
                                          f"(declares {declared(caps.dtypes)})"))
        elif dtype in excluded:
            out.append((f"dtype-{dtype}", f"{dtype}: {excluded[dtype]}"))
        elif dtype not in caps.kv_cache_dtypes:
            out.append((f"kv-{dtype}", f"{dtype} KV cache not declared (declares "
                                       f"{declared(caps.kv_cache_dtypes)}); {dtype} compute "
                                       f"runs only over FP8 caches, if declared"))
    for kv in FP8:
        if kv not in caps.kv_cache_dtypes:
            out.append((f"kv-{kv}", f"{kv} KV cache not declared"))
    for page in PAGE_SIZES:
        if not caps.page_sizes.accepts(page):
            out.append((f"page{page}", f"page size {page} not declared "
                                       f"(declares {caps.page_sizes.describe()})"))
    if caps.head_sizes is not None:
        for dim in HEAD_DIMS:
            if dim not in caps.head_sizes:
                out.append((f"d{dim}", f"head dim {dim} not declared "
                                       f"(declares {declared(caps.head_sizes)})"))
    for kind in ("MHA", "GQA", "MQA"):  # every declared one runs (see backend_shapes)
        if kind not in caps.attention_kinds:
            out.append((kind, f"attention kind {kind} not declared "
                              f"(declares {declared(caps.attention_kinds)})"))
    if "MLA" in caps.attention_kinds:
        out.append(("MLA", "MLA is declared but not covered by this suite"))
    for phase, mode in (("decode", "decode"), ("prefill", "extend")):
        if phase not in caps.phases:
            out.append((mode, f"{phase} phase not declared"))
    if not caps.verify_rows:
        out.append(("verify_rows", "decode rows of one request (speculative verify steps in "
                                   "decode graphs) not declared"))
    if not caps.sliding_window:
        out.append(("window", "sliding window not declared"))
    if not caps.logit_softcap:
        out.append(("softcap", "logit soft-cap not declared"))
    if not caps.sinks:
        out.append(("sinks", "attention sinks not declared"))
    return out
