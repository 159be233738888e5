"""The LoRA-backend conformance tests (core/contract/lora.py): a backend's `prepare` + `apply`
against an fp32 reference written here from the protocol's words (a per-token loop).

Collected by the conformance plugin (`pytest --conformance-lora NAME`, see conformance.plugin),
or by importing them into a test module:

    from conformance.lora_suite import *  # noqa: F401,F403

Parametrization: every registered LoRA backend that can run on each suite device, or only
those named (a named one that cannot run is one skip with the reason); devices from
--conformance-device, else cpu plus cuda when present (non-CPU cases carry the `gpu` mark);
x each case (CASES) x each declared compute dtype (on the CPU: float16 only for a Triton backend
under TRITON_INTERPRET=1, which runs fp16 dots right and bf16 ones wrong, so bf16 is left to
the GPU run there).

Cases: mixed adapters of ranks 8 to 64 in one batch (segments out of slot order, a slot used
by two segments), empty segments, base-only tokens (slot -1) left untouched, a step with only
base tokens, an empty step (T = 0), a single token, a prefill-sized step (165 tokens), fused
outputs (q/k/v-like and gate/up-like slices of unequal widths) and a plain projection,
decode-like batches (one token per segment), a decode-sized step with one adapter's 34 tokens
interleaved with other adapters' and base tokens (a backend may group tokens by adapter), a
--max-lora-rank that is not a power of two and a segment on an empty slot, ranks above a
backend's declared max_rank skipped.
Tolerances: fp32 1e-4, half precision 2e-2 (relative to the output's scale). The inputs x and
the buffers must be left as they were.

Tensor parallelism (`test_lora_backend_tensor_parallel`, backends whose LoRACaps declare
tensor_parallel; the others are one skip each, saying so): tp 2 and 4 simulated in one process
(no process group). Each rank's part of the adapters is cut the way the engine cuts it
(core.engine.lora: the base layer's core.layers.Linear.rank_rows / rank_inputs, a Linear built
for that rank): a column-parallel projection (fused q/k/v by heads with GQA's KV heads split at
tp 2 and replicated at tp 4, gate/up) keeps B's rows of its outputs and the rank's slice widths;
a row-parallel one (o, down) keeps A's columns of its inputs and x's, its y a partial sum. A
backend built per rank runs prepare + apply on its part; the ranks' column outputs, put
together, and the sum of their row-parallel partial outputs must equal the unsplit fp32
reference. The ranks' parts have shapes the unsplit cases do not (36 or 18 inputs, 18 rows):
tails of tiles a kernel must mask. Under the Triton interpreter these run at fp32 only (fp16
too with --conformance-full).

Decode graphs (`test_lora_backend_graph_step`, backends whose LoRACaps declare graph_safe; the
others are one skip each): device-only steps (LoRABatch.on_device: one token per row, slots on
the device only, the host lists unreadable) of 12, 72 and 160 rows (over the 64 tokens a backend
may serve token by token eagerly: decode buckets go to 256) and of 8 base or padded rows only,
base rows and padded rows (-1) between adapter rows, against the reference; then, as a replay
would, the same batch object's slot row and one slot's buffers changed in place, and prepare +
apply again must follow them.
Under the Triton interpreter fp32 only (fp16 too with --conformance-full).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import pytest
import torch

from conformance.attention_check import excluded_dtype_reasons, triton_interpreter
from conformance.suite_kit import Target, skip_param, suite_params
from core.contract.lora import BASE_SLOT, LoRABackend, LoRABatch, LoRAConfig, LoRAWeights

__all__ = ["pytest_generate_tests", "test_lora_backend_conformance",
           "test_lora_backend_graph_step", "test_lora_backend_tensor_parallel",
           "reference_lora"]

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
TOL = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 3e-2}


@dataclass(frozen=True)
class Case:
    id: str
    in_features: int
    slices: tuple[int, ...]  # output slices of the projection
    max_rank: int
    ranks: tuple[int, ...]  # per slot (0: empty slot)
    segments: tuple[tuple[int, int], ...]  # (length, slot) in token order


CASES = (
    Case("mixed-qkv", 48, (64, 16, 16), 64, (8, 16, 64, 32),
         ((5, 2), (3, -1), (7, 0), (0, 1), (4, 2), (6, 3), (2, -1), (9, 1))),
    Case("gate-up", 40, (72, 72), 16, (16, 8), ((11, 1), (13, 0), (1, -1), (3, 1))),
    Case("plain-proj", 64, (40,), 32, (32, 8, 24), ((4, 0), (4, 1), (4, 2), (0, 0))),
    Case("decode-like", 32, (32, 8, 8), 16, (8, 16, 12),
         tuple((1, s) for s in (0, 1, -1, 2, 0, 2, 1, -1, 1, 0))),
    Case("base-only", 32, (24, 24), 8, (8,), ((5, -1), (0, 0), (3, -1))),
    Case("empty-step", 32, (16, 8, 8), 8, (8, 8), ()),
    Case("all-empty-segments", 32, (16,), 8, (8, 8), ((0, 0), (0, 1), (0, -1))),
    # --max-lora-rank need not be a power of two; a segment on an empty slot (rank 0) adds 0
    Case("odd-max-rank", 40, (24, 8, 8), 24, (24, 12, 0),
         ((3, 0), (2, 2), (4, 1), (1, -1), (2, 0))),
    # a prefill-sized step (over 64 tokens: backends may serve long steps another way), long
    # segments not a multiple of any tile, a slot twice, an empty one, base tokens between
    Case("prefill-long", 48, (32, 16, 16), 32, (8, 32, 16),
         ((70, 1), (5, -1), (40, 0), (0, 2), (33, 2), (17, 1))),
    # a wide input (hidden sizes are thousands: backends may cut the shrink's K, and 600 is no
    # multiple of a power-of-two split), at decode and at prefill sizes
    Case("wide-in-decode", 600, (24, 8, 8), 16, (16, 8),
         tuple((1, s) for s in (0, 1, -1, 1, 0))),
    Case("wide-in-prefill", 600, (40,), 16, (8, 16), ((70, 1), (3, -1), (9, 0))),
    # a decode-sized step (56 tokens) a backend may group by adapter: slot 1's 34 tokens (more
    # than a tile of 16 or 32 rows) interleaved with three other slots' (one empty) and base
    # tokens, in runs of 1 to 4 tokens
    Case("decode-grouped", 32, (24, 8, 8), 16, (16, 8, 12, 0),
         ((1, 1), (1, 0), (2, 1), (1, -1), (1, 1), (1, 2), (3, 1), (1, 0), (1, -1), (1, 1),
          (1, 3), (2, 1), (1, 2), (1, 1), (1, 0), (1, 1), (2, -1), (1, 1), (1, 1), (1, 2),
          (4, 1), (1, 0), (1, 1), (1, -1), (1, 1), (1, 0), (2, 1), (1, 2), (1, 1), (1, 1),
          (1, -1), (1, 0), (3, 1), (1, 3), (1, 1), (1, 2), (1, 1), (1, -1), (1, 0), (3, 1),
          (1, -1), (2, 1))),
    Case("single-token", 32, (16, 8, 8), 8, (8, 8), ((1, 1),)),
)


def make_inputs(case: Case, dtype: torch.dtype, device: torch.device, seed: int):
    """(x, y, weights, batch) of a case: random A/B (zero beyond each slot's rank), scalings."""
    g = torch.Generator().manual_seed(seed)
    T = sum(n for n, _ in case.segments)
    slots, R, n = len(case.ranks), case.max_rank, len(case.slices)
    out = sum(case.slices)
    a = torch.zeros(slots, n * R, case.in_features)
    b = torch.zeros(slots, out, R)
    for s, r in enumerate(case.ranks):
        for j in range(n):
            a[s, j * R:j * R + r] = torch.randn(r, case.in_features, generator=g) / r ** 0.5
        b[s, :, :r] = torch.randn(out, r, generator=g)
    scalings = torch.rand(slots, generator=g) + 0.5
    x = torch.randn(T, case.in_features, generator=g)
    y = torch.randn(T, out, generator=g)
    seg_lens = [n for n, _ in case.segments]
    seg_slots = [s for _, s in case.segments]
    indptr = [0]
    for k in seg_lens:
        indptr.append(indptr[-1] + k)
    batch = LoRABatch(seg_lens=seg_lens, seg_slots=seg_slots, ranks=list(case.ranks),
                      seg_indptr=torch.tensor(indptr, dtype=torch.int32, device=device),
                      seg_slots_t=torch.tensor(seg_slots, dtype=torch.int32, device=device))
    weights = LoRAWeights(a=a.to(device, dtype), b=b.to(device, dtype),
                          scalings=scalings.to(device), output_slices=case.slices, max_rank=R)
    return x.to(device, dtype), y.to(device, dtype), weights, batch


def reference_lora(x: torch.Tensor, y: torch.Tensor, weights: LoRAWeights,
                   seg_lens: Sequence[int], seg_slots: Sequence[int]) -> torch.Tensor:
    """The protocol's sum, token by token in fp32: y_t + scale_s * x_t @ A_j^T @ B_j^T per
    output slice j, s the slot of t's segment (-1: y_t unchanged)."""
    R = weights.max_rank
    out = y.float().clone()
    a, b = weights.a.float(), weights.b.float()
    t = 0
    for n, s in zip(seg_lens, seg_slots, strict=True):
        for _ in range(n):
            if s != BASE_SLOT:
                off = 0
                for j, width in enumerate(weights.output_slices):
                    xa = a[s, j * R:(j + 1) * R] @ x[t].float()  # [R]
                    out[t, off:off + width] += float(weights.scalings[s]) * (
                        b[s, off:off + width] @ xa)
                    off += width
            t += 1
    return out


def check_case(factory, case: Case, dtype: torch.dtype, device: torch.device, seed: int) -> None:
    backend = factory(LoRAConfig(num_slots=len(case.ranks), max_rank=case.max_rank,
                                 dtype=dtype, device=device))
    assert isinstance(backend, LoRABackend), (
        f"the factory built {type(backend).__name__}, which lacks prepare / apply")
    x, y, weights, batch = make_inputs(case, dtype, device, seed)
    want = reference_lora(x, y, weights, batch.seg_lens, batch.seg_slots)
    saved = (x.clone(), weights.a.clone(), weights.b.clone(), weights.scalings.clone())
    meta = backend.prepare(batch)
    got = backend.apply(x, y, weights, batch, meta)
    assert got.shape == want.shape, f"apply returned shape {tuple(got.shape)}, not {tuple(want.shape)}"
    assert got.dtype == dtype, f"apply returned {got.dtype}, not {dtype}"
    scale = max(1.0, float(want.abs().max())) if want.numel() else 1.0
    err = float((got.float() - want).abs().max()) if want.numel() else 0.0
    assert err <= TOL[dtype] * scale, (f"{case.id} {dtype}: max |got - reference| = {err:.3g} "
                                       f"over tolerance {TOL[dtype] * scale:.3g}")
    t = 0
    for n, s in zip(batch.seg_lens, batch.seg_slots, strict=True):  # base tokens: exact
        if s == BASE_SLOT and n:
            assert torch.equal(got[t:t + n].float(), want[t:t + n]), (
                f"{case.id}: base-only tokens {t}..{t + n - 1} changed")
        t += n
    for before, after, what in zip(saved, (x, weights.a, weights.b, weights.scalings),
                                   ("x", "A", "B", "scalings"), strict=True):
        assert torch.equal(before, after), f"{case.id}: apply changed its input {what}"
    # the same metadata serves every projection of the step: a second projection's call
    x2, y2, w2, _ = make_inputs(case, dtype, device, seed + 1)
    want2 = reference_lora(x2, y2, w2, batch.seg_lens, batch.seg_slots)
    got2 = backend.apply(x2, y2, w2, batch, meta)
    err2 = float((got2.float() - want2).abs().max()) if want2.numel() else 0.0
    scale2 = max(1.0, float(want2.abs().max())) if want2.numel() else 1.0
    assert err2 <= TOL[dtype] * scale2, f"{case.id}: a second projection with one prepare"


@dataclass(frozen=True)
class TPCase:
    """A case's projection split over tensor-parallel ranks: `parallel` "column" (output rows;
    with `head_dim`, a fused q/k/v whose slices are heads of that size, the KV heads split or
    replicated as the model splits them) or "row" (inputs)."""

    case: Case
    parallel: str
    head_dim: int | None = None

    @property
    def id(self) -> str:
        return f"{self.case.id}-{self.parallel}"


_BY_ID = {c.id: c for c in CASES}
TP_SIZES = (2, 4)
TP_CASES = (
    # q 8 heads, k/v 2 heads of 8: at tp 2 each rank one KV head, at tp 4 two ranks per head
    TPCase(_BY_ID["mixed-qkv"], "column", head_dim=8),
    TPCase(_BY_ID["gate-up"], "column"),  # 18 rows a slice at tp 4
    # prefill-sized, q 4 heads, k/v 2: one q head a rank at tp 4, KV heads replicated
    TPCase(_BY_ID["prefill-long"], "column", head_dim=8),
    TPCase(_BY_ID["plain-proj"], "row"),  # o_proj-like
    # down_proj-like at decode: 36 / 18 inputs a rank
    TPCase(Case("down-decode", 72, (40,), 16, (8, 16, 12),
                tuple((1, s) for s in (0, 1, -1, 2, 0, 2, 1, -1, 1, 0))), "row"),
)


def rank_linear(tc: TPCase, rank: int, size: int):
    """This rank's base layer of the case's projection, built as the model builds it (on the
    meta device: only its split is used); (linear, shard names or None)."""
    from core.engine.distributed import TPGroup
    from core.layers import Linear, ModelContext

    case = tc.case
    tp = TPGroup(rank=rank, size=size)
    ctx = ModelContext(dtype=torch.float32, device=torch.device("meta"), tp=tp)
    if tc.parallel == "row":
        return Linear(case.in_features, list(case.slices), False, ctx, parallel="row"), None
    if tc.head_dim is None:
        names = [f"s{j}" for j in range(len(case.slices))]
        return Linear(case.in_features, list(case.slices), False, ctx, shard_names=names,
                      parallel="column"), names
    D = tc.head_dim  # q, k, v by heads, as plugins/models/llama.py splits them
    heads, kv_heads = case.slices[0] // D, case.slices[1] // D
    q0, nq = tp.split(heads, "attention heads")
    k0, nkv = tp.kv_heads(kv_heads)
    names = ["q", "k", "v"]
    return Linear(case.in_features, list(case.slices), False, ctx, shard_names=names,
                  parallel="column", shard_rows=[(q0 * D, nq * D), (k0 * D, nkv * D),
                                                 (k0 * D, nkv * D)]), names


def rank_part(tc: TPCase, linear, names, x: torch.Tensor, y: torch.Tensor, w: LoRAWeights,
              size: int) -> tuple[torch.Tensor, torch.Tensor, LoRAWeights, list[torch.Tensor]]:
    """(x, y, weights) of one rank, cut from the unsplit ones as core.engine.lora cuts an
    adapter: per slot and output slice, A_j through linear.rank_inputs, B_j's rows through
    linear.rank_rows, placed at the rank's rows of the slice (linear.shard_slice). Also, per
    slice, the unsplit output rows the rank holds (for putting the outputs together)."""
    R, slots = w.max_rank, w.a.shape[0]
    if tc.parallel == "row":  # A's columns of the rank's inputs, B whole; y a partial sum
        a = torch.stack([linear.rank_inputs(w.a[s]) for s in range(slots)]).contiguous()
        part = LoRAWeights(a=a, b=w.b.clone(), scalings=w.scalings.clone(),
                           output_slices=w.output_slices, max_rank=R)
        return linear.rank_inputs(x).contiguous(), (y / size).contiguous(), part, []
    b = torch.zeros(slots, linear.output_size, R, dtype=w.b.dtype, device=w.b.device)
    ys, rows, off = [], [], 0
    for j, (name, width) in enumerate(zip(names, w.output_slices, strict=True)):
        here = linear.shard_slice(name)
        idx = linear.rank_rows(torch.arange(width), name)  # the unsplit rows it keeps
        rows.append(idx)
        for s in range(slots):
            b[s, here] = linear.rank_rows(w.b[s, off:off + width], name)
        ys.append(y[:, off + idx.to(y.device)])
        off += width
        assert here.stop - here.start == len(idx), f"slice {j}: rank rows and shard slice"
    part = LoRAWeights(a=w.a.clone(), b=b, scalings=w.scalings.clone(),
                       output_slices=tuple(linear.output_sizes), max_rank=R)
    return x, torch.cat(ys, dim=1).contiguous(), part, rows


def check_tp_case(factory, tc: TPCase, size: int, dtype: torch.dtype, device: torch.device,
                  seed: int) -> None:
    """Every rank's prepare + apply on its part; the ranks' outputs put together (column) or
    summed (row) against the unsplit fp32 reference; base tokens of every rank untouched."""
    case = tc.case
    x, y, weights, batch = make_inputs(case, dtype, device, seed)
    want = reference_lora(x, y, weights, batch.seg_lens, batch.seg_slots).cpu()
    T, out = want.shape
    scale = max(1.0, float(want.abs().max())) if want.numel() else 1.0
    tol = TOL[dtype] * scale
    base_rows = [t for t, s in enumerate(s for n, s in zip(batch.seg_lens, batch.seg_slots,
                                                            strict=True) for _ in range(n))
                 if s == BASE_SLOT]
    where = f"{case.id} {tc.parallel}-parallel at tp {size}, {dtype}"
    total = torch.zeros(T, out)
    placed = torch.full((T, out), float("nan"))
    for rank in range(size):
        linear, names = rank_linear(tc, rank, size)
        xr, yr, wr, rows = rank_part(tc, linear, names, x, y, weights, size)
        yr_in = yr.clone()
        backend = factory(LoRAConfig(num_slots=len(case.ranks), max_rank=case.max_rank,
                                     dtype=dtype, device=device))
        got = backend.apply(xr, yr, wr, batch, backend.prepare(batch))
        assert got.shape == yr_in.shape and got.dtype == dtype, (
            f"{where}, rank {rank}: apply returned {tuple(got.shape)} {got.dtype}, not "
            f"{tuple(yr_in.shape)} {dtype}")
        if base_rows:
            assert torch.equal(got[base_rows], yr_in[base_rows]), (
                f"{where}, rank {rank}: base-only tokens changed")
        if tc.parallel == "row":
            total += got.float().cpu()
            continue
        off, at = 0, 0
        for idx, width in zip(rows, weights.output_slices, strict=True):
            mine = got[:, at:at + len(idx)].float().cpu()
            err = float((mine - want[:, off + idx]).abs().max()) if T else 0.0
            assert err <= tol, (f"{where}, rank {rank}: its rows {off + int(idx[0])}.."
                                f"{off + int(idx[-1])} off the reference by {err:.3g} (tolerance "
                                f"{tol:.3g})")
            placed[:, off + idx] = mine
            off, at = off + width, at + len(idx)
    assembled = total if tc.parallel == "row" else placed
    err = float((assembled - want).abs().max()) if T else 0.0
    assert not assembled.isnan().any() and err <= tol, (
        f"{where}: the ranks' outputs {'summed' if tc.parallel == 'row' else 'put together'} "
        f"are off the unsplit reference by {err:.3g} (tolerance {tol:.3g})")


def _rows(n: int, slots: Sequence[int], padded: int) -> tuple[tuple[int, int], ...]:
    """n decode rows cycling over `slots`, then `padded` padded rows (slot -1)."""
    return tuple((1, slots[i % len(slots)]) for i in range(n)) + ((1, BASE_SLOT),) * padded


GRAPH_CASES = (
    # a small bucket: adapters of ranks 8, 16, 12 (max rank 16), base rows, 2 padded rows
    Case("graph-bucket-12", 32, (32, 8, 8), 16, (8, 16, 12), _rows(10, (0, 1, -1, 2, 0), 2)),
    # a bucket over 64 rows, a plain projection, one slot empty (rank 0)
    Case("graph-bucket-160", 40, (24,), 16, (16, 0, 8), _rows(157, (2, -1, 0, 0, 1), 3)),
    # 17 rows of each of 4 slots interleaved (one past a tile of 16 each: the most tiles a
    # grouping backend needs for 68 rows), 4 padded rows
    Case("graph-bucket-72", 32, (16, 8, 8), 8, (8, 4, 8, 2), _rows(68, (3, 0, 2, 1), 4)),
    # every row base or padding
    Case("graph-all-base", 32, (24,), 8, (8, 8), _rows(5, (-1,), 3)),
)


def check_graph_step(factory, case: Case, dtype: torch.dtype, device: torch.device,
                     seed: int) -> None:
    """A device-only step of `case` (every segment one token) against the reference; then the
    slot row and slot 0's buffers changed in place (a replay after a slot load) and prepare +
    apply again on the same batch object follow them (module doc)."""
    assert all(n == 1 for n, _ in case.segments), "a graph step has one token per segment"
    backend = factory(LoRAConfig(num_slots=len(case.ranks), max_rank=case.max_rank,
                                 dtype=dtype, device=device))
    x, y, weights, host = make_inputs(case, dtype, device, seed)
    slots_t = host.seg_slots_t.clone()
    batch = LoRABatch.on_device(host.seg_indptr.clone(), slots_t)
    tol = TOL[dtype]
    for round_ in range(2):
        seg_slots = slots_t.tolist()
        want = reference_lora(x, y, weights, [1] * len(seg_slots), seg_slots)
        got = backend.apply(x, y.clone(), weights, batch, backend.prepare(batch))
        scale = max(1.0, float(want.abs().max()))
        err = float((got.float() - want).abs().max())
        where = f"{case.id} {dtype}, {'first step' if round_ == 0 else 'after a slot reload'}"
        assert err <= tol * scale, (f"{where}: max |got - reference| = {err:.3g} over "
                                    f"tolerance {tol * scale:.3g}")
        base = [t for t, s in enumerate(seg_slots) if s == BASE_SLOT]
        assert torch.equal(got[base].float(), want[base]), f"{where}: base rows changed"
        # between replays: rows change adapters, slot 0 gets another adapter in place
        g = torch.Generator().manual_seed(seed + 7)
        slots_t.copy_(slots_t.roll(1))
        r = case.ranks[0]
        for j in range(len(case.slices)):
            weights.a[0, j * case.max_rank:j * case.max_rank + r].copy_(
                torch.randn(r, case.in_features, generator=g).to(device, dtype) / r ** 0.5)
        weights.b[0, :, :r].copy_(torch.randn(weights.b.shape[1], r, generator=g))
        weights.scalings[0] = 1.5


def _dtype_params(t: Target, case: Case) -> list[str]:
    """The declared compute dtypes the suite runs `case` at on t's device (none beyond its
    declared max rank)."""
    if case.max_rank > t.reg.caps.max_rank:
        return []  # beyond its declared ranks: not its contract
    excluded = excluded_dtype_reasons(t.reg, t.device)
    interpreted = triton_interpreter(t.reg, t.device)
    names = []
    for dname in sorted(t.reg.caps.dtypes):
        if dname in excluded:
            continue  # bf16 under the Triton interpreter: a GPU check
        if t.device.type == "cpu" and dname == "float16" and not interpreted:
            continue  # CPU half matmuls: slow and not what a CPU serves
        names.append(dname)
    return names


def lora_params(config: pytest.Config) -> list:
    def cases(t: Target) -> list:
        return [pytest.param(t.name, t.device_name, case, dname, t.seed,
                             id=f"{t.name}-{t.device_name}-{case.id}-{dname}", marks=t.marks)
                for case in CASES for dname in _dtype_params(t, case)]

    return suite_params(config, "lora", "conformance_lora", "LoRA backend", cases, width=5,
                        say_device=False)


def lora_tp_params(config: pytest.Config) -> list:
    def cases(t: Target) -> list:
        if not t.reg.caps.tensor_parallel:
            return [skip_param(f"{t.name}-{t.device_name}-tp",
                               f"{t.name} declares tensor_parallel=False (LoRACaps): it is "
                               "not run with --tp-size > 1, so not checked sharded", t.marks,
                               width=6)]
        # under the Triton interpreter (CI's CPU run, seconds a case) fp32 alone unless
        # --conformance-full: the unsplit cases run fp16 there, the sharded arithmetic is the same
        interpreted = triton_interpreter(t.reg, t.device) and not t.full
        return [pytest.param(t.name, t.device_name, tc, size, dname, t.seed,
                             id=f"{t.name}-{t.device_name}-{tc.id}-tp{size}-{dname}",
                             marks=t.marks)
                for tc in TP_CASES for size in TP_SIZES for dname in _dtype_params(t, tc.case)
                if not (interpreted and dname != "float32")]

    return suite_params(config, "lora", "conformance_lora", "LoRA backend", cases, width=6,
                        say_device=False)


def lora_graph_params(config: pytest.Config) -> list:
    def cases(t: Target) -> list:
        if not t.reg.caps.graph_safe:
            return [skip_param(f"{t.name}-{t.device_name}-graph",
                               f"{t.name} declares graph_safe=False (LoRACaps): decode graphs "
                               "are not captured with it, so its device-only steps are not "
                               "checked", t.marks, width=5)]
        interpreted = triton_interpreter(t.reg, t.device) and not t.full
        return [pytest.param(t.name, t.device_name, case, dname, t.seed,
                             id=f"{t.name}-{t.device_name}-{case.id}-{dname}", marks=t.marks)
                for case in GRAPH_CASES for dname in _dtype_params(t, case)
                if not (interpreted and dname != "float32")]

    return suite_params(config, "lora", "conformance_lora", "LoRA backend", cases, width=5,
                        say_device=False)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    name = metafunc.function.__name__
    if name == "test_lora_backend_conformance":
        metafunc.parametrize("lora_name,lora_device,lora_case,lora_dtype,lora_seed",
                             lora_params(metafunc.config))
    elif name == "test_lora_backend_graph_step":
        metafunc.parametrize("lora_name,lora_device,lora_graph_case,lora_dtype,lora_seed",
                             lora_graph_params(metafunc.config))
    elif name == "test_lora_backend_tensor_parallel":
        metafunc.parametrize("lora_name,lora_device,lora_tp_case,lora_tp,lora_dtype,lora_seed",
                             lora_tp_params(metafunc.config))


def test_lora_backend_conformance(lora_name, lora_device, lora_case, lora_dtype, lora_seed):
    """The backend's prepare + apply equal the fp32 reference on one case (module doc)."""
    from core.plan.registry import get_registry

    reg = get_registry().get("lora", lora_name)
    check_case(reg.load(), lora_case, DTYPES[lora_dtype], torch.device(lora_device), lora_seed)


def test_lora_backend_graph_step(lora_name, lora_device, lora_graph_case, lora_dtype,
                                 lora_seed):
    """A graph-safe backend's device-only decode steps (slots on the device only, host lists
    unreadable), before and after in-place changes of the slot row and a slot's buffers, equal
    the fp32 reference (module doc)."""
    from core.plan.registry import get_registry

    reg = get_registry().get("lora", lora_name)
    check_graph_step(reg.load(), lora_graph_case, DTYPES[lora_dtype], torch.device(lora_device),
                     lora_seed)


def test_lora_backend_tensor_parallel(lora_name, lora_device, lora_tp_case, lora_tp,
                                      lora_dtype, lora_seed):
    """Each simulated rank's prepare + apply on its part of the adapters; the ranks' outputs
    put together (column-parallel) or summed (row-parallel) equal the unsplit fp32 reference
    (module doc)."""
    from core.plan.registry import get_registry

    reg = get_registry().get("lora", lora_name)
    check_tp_case(reg.load(), lora_tp_case, lora_tp, DTYPES[lora_dtype],
                  torch.device(lora_device), lora_seed)
