"""The model runner: turns a scheduler step into ForwardBatch tensors, runs the model, returns
the logits the sampler needs.

One attention backend per phase (the plan's prefill_attention / decode_attention; one instance
when both name the same backend). Extend and decode run as separate forwards, so each backend only
ever sees its own phase. Everything runs under torch.inference_mode; host-side lengths travel in
the batch's *_cpu lists so backends never sync with the device to read them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from core.contract.attention import AttentionBackend, BackendContext
from core.contract.forward_batch import ForwardBatch, ForwardMode
from core.contract.lora import BASE_SLOT
from core.contract.platform import Platform, platform_for_device
from core.engine.memory.kv_cache import KVPool, MLAKVPool
from core.engine.memory.memory_pool import ReqToTokenPool

if TYPE_CHECKING:
    from torch import nn

    from core.contract.graphs import GraphRunner
    from core.engine.lora import LoRAManager
    from core.plan.registry import Registry


def make_backends(registry: Registry, prefill: str, decode: str, ctx: BackendContext
                  ) -> tuple[AttentionBackend, AttentionBackend]:
    """Instantiate the plan's attention backends (the factories import their kernels here)."""
    made: dict[str, AttentionBackend] = {}
    for name in (prefill, decode):
        if name not in made:
            reg = registry.get("attention", name)
            if reg is None:
                raise ValueError(f"attention backend {name!r} is not registered")
            made[name] = reg.load()(ctx)
    return made[prefill], made[decode]


class ModelRunner:
    """Runs extend (prefill, possibly over a cached prefix or in chunks) and decode forwards.

    With a hybrid KV pool (core.engine.memory.kv_groups), `kv_pool` is group 0's (the full
    layers') and `group_pools[g - 1]` group g's; each group has its own table
    (req_to_token.tables[g]) and backend instances (`group_backends[g - 1]`: prefill, decode),
    and every forward is given each group's new-token slots (`group_slots`). The step's batch
    then carries one view per group (ForwardBatch.groups), which each layer picks by its id.
    """

    def __init__(self, model: nn.Module, kv_pool: KVPool | MLAKVPool, req_to_token: ReqToTokenPool,
                 prefill_backend: AttentionBackend, decode_backend: AttentionBackend,
                 device: torch.device | str, platform: Platform | None = None,
                 group_pools: Sequence[KVPool] = (),
                 group_backends: Sequence[tuple[AttentionBackend, AttentionBackend]] = (),
                 layer_group: Sequence[int] | None = None,
                 group_windows: Sequence[int | None] = ()):
        """group_windows[g - 1]: the sliding window of group g's layers (decode graphs size
        that group's KV splits for it, not for the whole context)."""
        self.model = model
        self.kv_pool = kv_pool
        self.group_pools = list(group_pools)
        self.group_backends = list(group_backends)
        self.group_windows = list(group_windows) or [None] * len(self.group_pools)
        self.layer_group = tuple(layer_group) if layer_group is not None else None
        if len(self.group_backends) != len(self.group_pools) or (
                bool(self.group_pools) != (self.layer_group is not None)) or (
                len(self.group_windows) != len(self.group_pools)):
            raise ValueError("a hybrid KV pool needs one backend pair (and at most one window) "
                             "per extra group and the layers' groups")
        self.req_to_token = req_to_token
        self.prefill_backend = prefill_backend
        self.decode_backend = decode_backend
        self.device = torch.device(device)
        if platform is None:  # in-process use (tests, tools): the platform of this device
            platform = platform_for_device(self.device)
        self.platform = platform
        # Loading is over: weights move to the layout the device's kernels stream fastest.
        self.notes: list[str] = list(platform.post_load(model))
        self.forward_count = {"extend": 0, "decode": 0}
        # The platform's graph runner when decode graphs were captured; batches it cannot take
        # (larger than its largest bucket) run eagerly below.
        self.graph_runner: GraphRunner | None = None
        # LoRA adapters (core.engine.lora), when the plan serves them: the slot each request's
        # tokens use is given per step (`lora`: one slot per row, -1 the base model)
        self.lora: LoRAManager | None = None
        # speculative verify steps replay the decode graphs as decode rows (Plan.
        # spec_verify_graphs: the decode backend declares AttentionCaps.verify_rows)
        self.verify_graphs = False

    def _tensor(self, values: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        return self.platform.to_device(torch.tensor(values, dtype=dtype), self.device)

    @property
    def num_groups(self) -> int:
        return 1 + len(self.group_pools)

    def _begin_step(self) -> None:
        self.kv_pool.begin_step()
        for p in self.group_pools:
            p.begin_step()

    def _with_groups(self, batch: ForwardBatch, locs: Sequence[torch.Tensor]) -> None:
        """Attach the other groups' views of `batch` (their new-token slots `locs`)."""
        views = [dataclasses.replace(batch, out_cache_loc=loc, req_to_token=table, kv_pool=pool)
                 for loc, table, pool in zip(locs, self.req_to_token.tables[1:],
                                             self.group_pools, strict=True)]
        batch.groups = (batch, *views)
        batch.layer_group = self.layer_group

    def _run(self, batch: ForwardBatch, backend: AttentionBackend,
             logit_index: torch.Tensor | None,
             keep: dict[int, tuple[int, int]] | None = None,
             kept: dict[int, torch.Tensor] | None = None,
             lora: Sequence[int] | None = None) -> torch.Tensor:
        batch.attn_backend = backend
        batch.attn_meta = backend.prepare(batch)
        if batch.groups is not None:  # each group's backend prepares its own view
            phase = 0 if backend is self.prefill_backend else 1
            for view, pair in zip(batch.groups[1:], self.group_backends, strict=True):
                view.attn_backend = pair[phase]
                view.attn_meta = pair[phase].prepare(view)
        if self.lora is not None:
            self.lora.begin_step(batch.extend_lens_cpu, lora)
        with torch.inference_mode():
            hidden = self.model.forward(batch.input_ids, batch.positions, batch)  # [T, H]
            for i, (start, n) in (keep or {}).items():
                kept[i] = hidden[start:start + n]
            if logit_index is not None:
                hidden = hidden.index_select(0, logit_index)  # [N, H]
            return self.model.compute_logits(hidden)  # [N, vocab] fp32

    def extend(self, rows: Sequence[int], prefix_lens: Sequence[int],
               tokens: Sequence[Sequence[int]], slots: Sequence[Sequence[int]],
               logits_for: Sequence[int], hidden_for: Sequence[int] = (),
               hidden_out: dict[int, torch.Tensor] | None = None,
               group_slots: Sequence[Sequence[Sequence[int]]] = (),
               lora: Sequence[int] | None = None) -> torch.Tensor | None:
        """Compute K/V of `tokens[i]` (positions prefix_lens[i]...) for request row rows[i].

        The rows' prefix slots must already be in the table; this writes the new ones.
        Returns logits [len(logits_for), V] at the last new token of each request listed in
        `logits_for` (indices into rows), or None when none is listed. For each index i in
        `hidden_for`, hidden_out[i] gets the final hidden states of all of tokens[i]
        ([len(tokens[i]), H]; `logits` turns them into logits: prompt logprobs).
        group_slots[g - 1][i]: request i's new slots in KV group g (a hybrid pool). lora: the
        LoRA slot of each row (None: the base model for all).
        """
        self.forward_count["extend"] += 1
        batch, ext = self._extend_batch(rows, prefix_lens, tokens, slots, group_slots)
        ends, t = [], 0
        for n in ext:
            t += n
            ends.append(t - 1)
        keep = {i: (ends[i] + 1 - ext[i], ext[i]) for i in hidden_for}
        if not logits_for:
            self._run(batch, self.prefill_backend, torch.empty(0, dtype=torch.long,
                                                               device=self.device),
                      keep, hidden_out, lora)
            return None
        index = self._tensor([ends[i] for i in logits_for], torch.long)
        return self._run(batch, self.prefill_backend, index, keep, hidden_out, lora)

    def _extend_batch(self, rows: Sequence[int], prefix_lens: Sequence[int],
                      tokens: Sequence[Sequence[int]], slots: Sequence[Sequence[int]],
                      group_slots: Sequence[Sequence[Sequence[int]]] = ()
                      ) -> tuple[ForwardBatch, list[int]]:
        """The EXTEND batch of `tokens[i]` at positions prefix_lens[i]... of rows[i] (their
        slots written into the table), and the extend lengths."""
        self._begin_step()
        if len(group_slots) != len(self.group_pools):
            raise ValueError(f"{len(group_slots)} groups' slots for a pool of "
                             f"{self.num_groups} KV groups")
        ext = [len(t) for t in tokens]
        seq = [p + n for p, n in zip(prefix_lens, ext, strict=True)]
        flat_ids: list[int] = []
        flat_pos: list[int] = []
        flat_slots: list[int] = []
        for row, p, toks, sl in zip(rows, prefix_lens, tokens, slots, strict=True):
            self.req_to_token.write(row, p, sl)
            flat_ids.extend(toks)
            flat_pos.extend(range(p, p + len(toks)))
            flat_slots.extend(sl)
        batch = ForwardBatch(
            mode=ForwardMode.EXTEND,
            input_ids=self._tensor(flat_ids, torch.long),
            positions=self._tensor(flat_pos, torch.long),
            seq_lens=self._tensor(seq, torch.int32),
            prefix_lens=self._tensor(prefix_lens, torch.int32),
            extend_lens=self._tensor(ext, torch.int32),
            out_cache_loc=self._tensor(flat_slots, torch.long),
            req_pool_indices=self._tensor(rows, torch.long),
            req_to_token=self.req_to_token.req_to_token,
            kv_pool=self.kv_pool,
            seq_lens_cpu=seq, prefix_lens_cpu=list(prefix_lens), extend_lens_cpu=ext)
        if self.group_pools:
            locs = []
            for g, per_req in enumerate(group_slots, start=1):
                flat = []
                for row, p, sl in zip(rows, prefix_lens, per_req, strict=True):
                    self.req_to_token.write(row, p, sl, group=g)
                    flat.extend(sl)
                locs.append(self._tensor(flat, torch.long))
            self._with_groups(batch, locs)
        return batch, ext

    def verify(self, rows: Sequence[int], prefix_lens: Sequence[int],
               tokens: Sequence[Sequence[int]], slots: Sequence[Sequence[int]],
               group_slots: Sequence[Sequence[Sequence[int]]] = (),
               lora: Sequence[int] | None = None) -> torch.Tensor:
        """Speculative verification: one extend forward of each request's [last token +
        drafts] over its cached prefix (K/V written to `slots`, the rejected ones' too: the
        scheduler frees their pages) -> logits at every new position [sum(len(t)), V]."""
        self.forward_count["verify"] = self.forward_count.get("verify", 0) + 1
        if self.verify_graphs and self.graph_runner is not None:
            # Each verified token as a decode row of its request at its own position: the
            # decode backend stores every row's K/V before any row attends (verify_rows), so
            # row j sees the last token and drafts 0..j-1, as the extend would.
            n = [len(t) for t in tokens]
            expand = [i for i, k in enumerate(n) for _ in range(k)]
            self._begin_step()
            logits = self._replay(
                [rows[i] for i in expand], [t for toks in tokens for t in toks],
                [p + j for p, k in zip(prefix_lens, n, strict=True) for j in range(k)],
                [s for sl in slots for s in sl],
                [[s for per in g for s in per] for g in group_slots],
                None if lora is None else [lora[i] for i in expand])
            if logits is not None:
                self.forward_count["verify_graph"] = self.forward_count.get(
                    "verify_graph", 0) + 1
                return logits
        batch, _ = self._extend_batch(rows, prefix_lens, tokens, slots, group_slots)
        return self._run(batch, self.prefill_backend, None, lora=lora)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final hidden states [N, H] (from extend's hidden_out) -> fp32 logits [N, V]."""
        with torch.inference_mode():
            return self.model.compute_logits(hidden)

    def warmup(self, shapes: Sequence[tuple[int, int]]) -> int:
        """Run throw-away extend forwards of (requests, tokens each) so that kernels compile at
        startup, not in the first user request that needs them (Triton compiles one variant per
        tiling and per specialization of its integer arguments). Every token's K/V goes to slot 0,
        the pool's padding sink, through request rows 0..requests-1 (all their table entries
        point at the sink; a row's entries are rewritten when a request takes it). Returns the
        number of forwards run; the forward counters are left as they were."""
        before = dict(self.forward_count)
        rows_free = self.req_to_token.max_reqs
        done = 0
        for n_req, n_tok in shapes:
            n_req = min(n_req, rows_free)
            n_tok = min(n_tok, self.req_to_token.max_context)
            if n_req < 1 or n_tok < 1:
                continue
            sink = [[0] * n_tok] * n_req
            self.extend(list(range(n_req)), [0] * n_req, [[1] * n_tok] * n_req, sink, [],
                        group_slots=[sink] * len(self.group_pools))
            done += 1
        if done:
            self.platform.synchronize(self.device)
        self.forward_count = before
        return done

    def _replay(self, rows: Sequence[int], input_ids: Sequence[int] | torch.Tensor,
                positions: Sequence[int], slots: Sequence[int],
                group_slots: Sequence[Sequence[int]], lora: Sequence[int] | None
                ) -> torch.Tensor | None:
        """The decode rows replayed in a captured graph -> logits [B, V], or None when no
        graph takes them (no graphs, too many rows, or adapters the graphs do not hold)."""
        # Graphs captured with a graph-safe LoRA backend hold the adapters' deltas (each row's
        # slot is a graph input): every step replays them. Graphs without (no LoRA, or a backend
        # that is not graph safe) serve steps of base requests alone; adapter steps run eagerly.
        gr = self.graph_runner
        if gr is None or not gr.can_run(len(rows)) or not (
                gr.captures_lora or lora is None or self.lora is None
                or all(s == BASE_SLOT for s in lora)):
            return None
        if gr.captures_lora:
            return gr.decode(rows, input_ids, positions, slots, group_slots, lora=lora)
        if self.lora is not None:
            self.lora.end_step()  # what the graphs were captured with: no delta
        return gr.decode(rows, input_ids, positions, slots, group_slots)

    def decode(self, rows: Sequence[int], input_ids: Sequence[int] | torch.Tensor,
               positions: Sequence[int], slots: Sequence[int],
               group_slots: Sequence[Sequence[int]] = (),
               lora: Sequence[int] | None = None) -> torch.Tensor:
        """One new token per request at `positions[i]` (= tokens already cached) -> [B, V].

        `input_ids` may be a device tensor (the previous step's sampled tokens, not yet seen by
        the host: the overlap scheduler). group_slots[g - 1][i]: request i's new slot in KV
        group g (a hybrid pool; graph replays take them too)."""
        self.forward_count["decode"] += 1
        self._begin_step()  # graph replays write the pool too
        if len(group_slots) != len(self.group_pools):
            raise ValueError(f"{len(group_slots)} groups' slots for a pool of "
                             f"{self.num_groups} KV groups")
        logits = self._replay(rows, input_ids, positions, slots, group_slots, lora)
        if logits is not None:
            return logits
        seq = [p + 1 for p in positions]
        B = len(rows)
        on_device = isinstance(input_ids, torch.Tensor)
        # One host->device copy for the four per-request vectors (and each group's slots).
        packed = self._tensor([*([0] * B if on_device else input_ids), *positions, *slots,
                               *rows, *(s for gs in group_slots for s in gs)], torch.long)
        ids, pos, loc, row_t = (packed[:B], packed[B:2 * B], packed[2 * B:3 * B],
                                packed[3 * B:4 * B])
        if on_device:
            ids = input_ids.to(device=self.device, dtype=torch.long)
        self.req_to_token.req_to_token[row_t, pos] = loc.to(torch.int32)
        batch = ForwardBatch(
            mode=ForwardMode.DECODE, input_ids=ids, positions=pos,
            seq_lens=(pos + 1).to(torch.int32), prefix_lens=pos.to(torch.int32),
            extend_lens=torch.ones(B, dtype=torch.int32, device=self.device),
            out_cache_loc=loc, req_pool_indices=row_t,
            req_to_token=self.req_to_token.req_to_token, kv_pool=self.kv_pool,
            seq_lens_cpu=seq, prefix_lens_cpu=list(positions), extend_lens_cpu=[1] * B)
        if self.group_pools:
            locs = [packed[(4 + g) * B:(5 + g) * B] for g in range(len(self.group_pools))]
            for table, gl in zip(self.req_to_token.tables[1:], locs, strict=True):
                table[row_t, pos] = gl.to(torch.int32)
            self._with_groups(batch, locs)
        return self._run(batch, self.decode_backend, None, lora=lora)
