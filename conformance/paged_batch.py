"""Random paged batches for attention tests: a case description and the tensors it expands to.

A case names the geometry (heads, head dim, page size, dtypes), the batch (per-request sequence
and new-token lengths) and the features (window, soft-cap). `build_inputs` turns it into a KV pool
and a ForwardBatch the way the engine would hand them to a backend, with poison where nothing
should be read:

- every pool slot of every layer starts as NaN, except the cached prefixes of the batch's
  requests (random values) and slot 0, the padding sink (random finite garbage: the contract
  allows reading it for padding, never using it);
- the slots the step writes (`out_cache_loc`) are NaN until the backend writes them;
- request pages are scattered at random over the pool and table rows are chosen at random, so
  the page table is really used;
- table entries past a request's length point at slot 0.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field

import torch

from core.contract.attention import AttentionLayerParams, BackendContext
from core.contract.forward_batch import ForwardBatch, ForwardMode
from core.engine.memory.kv_cache import KVPool

TORCH_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
FP8 = ("fp8_e4m3", "fp8_e5m2")
# Per-tensor scales used for FP8 caches: deliberately not powers of two, so a scale applied twice,
# or not at all, shows.
FP8_SCALES = (0.37, 1.7)


def attention_kind(num_kv_heads: int, group: int) -> str:
    """The attention kind a model of this shape has, as core.plan.model_spec names it."""
    if num_kv_heads == 1:
        return "MQA"
    return "MHA" if group == 1 else "GQA"


@dataclass(frozen=True)
class AttentionCase:
    """One conformance case. In decode, every request has one new token (extend_lens all 1).
    In "verify_rows" each request's new tokens reach the backend as decode rows of that request,
    one per token at its own position (a speculative verify step, AttentionCaps.verify_rows)."""

    mode: str  # "decode" | "extend" | "verify_rows"
    num_kv_heads: int
    group: int  # query heads per KV head (1 = MHA)
    head_dim: int
    page_size: int
    dtype: str  # compute dtype
    kv_dtype: str
    seq_lens: tuple[int, ...]  # tokens per request after the step (prefix + new)
    extend_lens: tuple[int, ...]  # new tokens per request this step
    sliding_window: int | None = None
    logit_softcap: float | None = None
    sinks: bool = False  # a random sink logit per query head (AttentionLayerParams.sinks)
    layers: int = 1  # layers run in the step (from the last one down), after one prepare
    tag: str = ""  # what the case is about, for its id

    def __post_init__(self) -> None:
        if self.mode not in ("decode", "extend", "verify_rows"):
            raise ValueError(f"mode must be decode, extend or verify_rows, not {self.mode!r}")
        if len(self.seq_lens) != len(self.extend_lens) or not self.seq_lens:
            raise ValueError("seq_lens and extend_lens must be non-empty and of equal length")
        if any(n < 1 or n > s for s, n in zip(self.seq_lens, self.extend_lens, strict=True)):
            raise ValueError(f"every request needs 1 <= new tokens <= seq_len, got "
                             f"{self.extend_lens} for {self.seq_lens}")
        if self.mode == "decode" and set(self.extend_lens) != {1}:
            raise ValueError("decode cases have exactly one new token per request")
        for name in (self.dtype, self.kv_dtype):
            if name not in TORCH_DTYPES:
                raise ValueError(f"unknown dtype {name!r} (known: {', '.join(TORCH_DTYPES)})")

    @property
    def num_heads(self) -> int:
        return self.num_kv_heads * self.group

    @property
    def kind(self) -> str:
        return attention_kind(self.num_kv_heads, self.group)

    @property
    def prefix_lens(self) -> tuple[int, ...]:
        return tuple(s - n for s, n in zip(self.seq_lens, self.extend_lens, strict=True))

    @property
    def id(self) -> str:
        kv = "" if self.kv_dtype == self.dtype else f"-kv_{self.kv_dtype}"
        extra = "".join([f"-win{self.sliding_window}" if self.sliding_window else "",
                         f"-cap{self.logit_softcap:g}" if self.logit_softcap else "",
                         "-sinks" if self.sinks else "",
                         f"-{self.layers}layers" if self.layers > 1 else "",
                         f"-{self.tag}" if self.tag else ""])
        return (f"{self.mode}-h{self.num_heads}kv{self.num_kv_heads}-d{self.head_dim}"
                f"-p{self.page_size}-{self.dtype}{kv}-b{len(self.seq_lens)}{extra}")

    def seed(self, base: int = 0) -> int:
        """A stable seed per case (and per --conformance-seed), so failures reproduce."""
        return zlib.crc32(f"{base}:{self.id}".encode())


@dataclass
class PagedInputs:
    """A built case: pool, batch, per-layer inputs, and the pool as it must be after the step."""

    case: AttentionCase
    ctx: BackendContext
    pool: KVPool
    batch: ForwardBatch
    layers: list[AttentionLayerParams]  # in the order they run
    qkv: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]  # per layer run: [T, H*D]...
    before: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # per layer id
    expected: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)


def quantize(x: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """What a KV write stores: x / scale in the cache dtype (scale is 1 off FP8)."""
    return (x.float() / scale).to(dtype) if scale != 1.0 else x.to(dtype)


def dequantize(x: torch.Tensor, scale: float) -> torch.Tensor:
    """Stored cache values back to real fp32 values (NaN poison stays NaN)."""
    return x.float() * scale


def _pages(case: AttentionCase, gen: torch.Generator) -> tuple[int, list[list[int]]]:
    ps = case.page_size
    need = [-(-s // ps) for s in case.seq_lens]
    # Spare pages stay poisoned; page 0 (slot 0, the padding sink) is never handed out.
    num_pages = sum(need) + max(2, sum(need) // 4) + 1
    order = (torch.randperm(num_pages - 1, generator=gen) + 1).tolist()
    tables, taken = [], 0
    for n in need:
        tables.append(order[taken:taken + n])
        taken += n
    return num_pages, tables


def build_inputs(case: AttentionCase, device: torch.device | str, seed: int) -> PagedInputs:
    """Expand `case` into a poisoned pool and a ForwardBatch on `device` (see module doc)."""
    device = torch.device(device)
    gen = torch.Generator().manual_seed(seed)  # layout (small, host side)
    data = torch.Generator(device=device).manual_seed(seed)  # tensor values, made on the device
    dtype, kv_dtype = TORCH_DTYPES[case.dtype], TORCH_DTYPES[case.kv_dtype]
    k_scale, v_scale = FP8_SCALES if case.kv_dtype in FP8 else (1.0, 1.0)
    H, Hkv, D, ps = case.num_heads, case.num_kv_heads, case.head_dim, case.page_size
    B = len(case.seq_lens)
    num_layers = max(2, case.layers)  # a spare layer shows writes to the wrong layer

    num_pages, tables = _pages(case, gen)
    num_slots = num_pages * ps
    max_ctx = max(case.seq_lens) + 7  # a ragged table wider than any request
    rows = torch.randperm(B + 3, generator=gen)[:B]
    req_to_token = torch.zeros(B + 3, max_ctx, dtype=torch.int32)
    slots_of = []
    for i, (s, pages) in enumerate(zip(case.seq_lens, tables, strict=True)):
        j = torch.arange(s)
        slots = torch.tensor(pages, dtype=torch.int64)[j // ps] * ps + j % ps
        req_to_token[rows[i], :s] = slots.to(torch.int32)
        slots_of.append(slots)
    prefix = case.prefix_lens
    out_loc = torch.cat([slots_of[i][prefix[i]:] for i in range(B)]).to(device)
    cached = torch.cat([slots_of[i][:prefix[i]] for i in range(B)]).to(device)
    T = int(out_loc.numel())

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=data, device=device)

    pool = KVPool(num_slots, num_layers, Hkv, D, kv_dtype, device, ps, k_scale=k_scale,
                  v_scale=v_scale)
    before = []
    for layer_id in range(num_layers):
        for buf, scale in zip(pool.get_kv_buffer(layer_id), (k_scale, v_scale), strict=True):
            real = torch.full((num_slots, Hkv, D), float("nan"), device=device)
            real[0] = randn(Hkv, D)
            real[cached] = randn(len(cached), Hkv, D)
            buf.copy_(quantize(real, kv_dtype, scale))
        before.append(tuple(b.clone() for b in pool.get_kv_buffer(layer_id)))

    ext_t = torch.tensor(case.extend_lens, dtype=torch.int32)
    positions = torch.cat([torch.arange(p, s) for p, s in zip(prefix, case.seq_lens,
                                                               strict=True)])
    if case.mode == "verify_rows":  # one decode row per new token, at its own position
        seqs, prefixes, news = (positions + 1).tolist(), positions.tolist(), [1] * T
        rows = rows.repeat_interleave(ext_t)
    else:
        seqs, prefixes, news = list(case.seq_lens), list(prefix), list(case.extend_lens)
    batch = ForwardBatch(
        mode=ForwardMode.EXTEND if case.mode == "extend" else ForwardMode.DECODE,
        input_ids=torch.zeros(T, dtype=torch.int64, device=device),
        positions=positions.to(device),
        seq_lens=torch.tensor(seqs, dtype=torch.int32, device=device),
        prefix_lens=torch.tensor(prefixes, dtype=torch.int32, device=device),
        extend_lens=torch.tensor(news, dtype=torch.int32, device=device),
        out_cache_loc=out_loc,
        req_pool_indices=rows.to(device),
        req_to_token=req_to_token.to(device),
        kv_pool=pool,
        seq_lens_cpu=seqs,
        prefix_lens_cpu=prefixes,
        extend_lens_cpu=news,
    )
    ctx = BackendContext(num_heads=H, num_kv_heads=Hkv, head_dim=D, num_layers=num_layers,
                         dtype=dtype, kv_dtype=kv_dtype, device=device, page_size=ps,
                         max_context_len=max_ctx)

    q_gain = 4.0 if case.logit_softcap else 1.0  # large logits, so the cap really bites
    layers, qkv, expected = [], [], [list(b) for b in before]
    for layer_id in reversed(range(num_layers - case.layers, num_layers)):
        # sinks of about the scores' size (some rows mostly sink, some barely), fp32
        sinks = randn(H).float().mul_(2.0).to(device) if case.sinks else None
        layers.append(AttentionLayerParams(
            layer_id=layer_id, num_heads=H, num_kv_heads=Hkv, head_dim=D, scaling=D ** -0.5,
            sliding_window=case.sliding_window, logit_softcap=case.logit_softcap,
            sinks=sinks))
        q = (randn(T, H * D) * q_gain).to(dtype)
        k = randn(T, Hkv * D).to(dtype)
        v = randn(T, Hkv * D).to(dtype)
        qkv.append((q, k, v))
        for idx, (new, scale) in enumerate(((k, k_scale), (v, v_scale))):
            after = expected[layer_id][idx].clone()
            after[out_loc] = quantize(new.view(T, Hkv, D), kv_dtype, scale)
            expected[layer_id][idx] = after
    return PagedInputs(case, ctx, pool, batch, layers, qkv, before,
                       [tuple(e) for e in expected])
