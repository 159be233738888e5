"""The engine worker: plan, load, size the KV pool, build the scheduler, then serve the pipe.

`build_engine_core` is also used in-process (tests, benchmarks); `worker_main` is the entry of the
spawned process: it is given the parent's args and resolved plan as JSON (the plan is never
resolved again here) and speaks only typed messages (core.messages).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from core.messages import (
    Abort,
    AddRequest,
    Channel,
    ChannelClosed,
    EngineInfo,
    Fatal,
    Finish,
    GrammarReady,
    Heartbeat,
    Message,
    OutputItem,
    PrefillBudget,
    Ready,
    Reply,
    Rpc,
    Shutdown,
    StepOutput,
    TokenLogprob,
    decode,
    encode,
)
from core.plan.args import ServerArgs, make_server_args
from core.plan.hf_imports import keep_torchvision_out
from core.plan.plan import Plan

if TYPE_CHECKING:  # torch and the engine's modules are imported where a phase needs them
    from collections.abc import Callable, Sequence
    from multiprocessing.connection import Connection

    import torch

    from core.contract.platform import ModelGeometry, Platform
    from core.contract.spec import Proposer
    from core.engine.distributed import RankSpec, TPGroup
    from core.engine.draft import DraftModelRunner
    from core.engine.graphs import GraphDecision
    from core.engine.loader import HFConfig, LoadedModel
    from core.engine.lora import LoRAManager
    from core.engine.memory.kv_cache import KVPool, MLAKVPool
    from core.engine.memory.memory_pool import ReqToTokenPool
    from core.engine.model_runner import ModelRunner
    from core.engine.scheduler import Req, Scheduler
    from core.plan.model_spec import ModelSpec
    from core.plan.registry import Registry

GiB = 2**30
HEARTBEAT_S = 1.0  # the worker's liveness beat, sent from its own thread (steps may be long)
SNAPSHOT_S = 0.25  # how often, at most, the loop refreshes the stats the heartbeat carries
# grammar compile processes per worker (core.engine.grammar_compiler): a slow compile holds one, the
# other keeps compiling the next requests' constraints
GRAMMAR_COMPILE_PROCESSES = 2


def make_plan(args: ServerArgs, registry: Registry | None = None
              ) -> tuple[ServerArgs, Plan, ModelSpec, Registry]:
    """(args with the model path filled in, plan, model spec, registry)."""
    from core.plan.devices import select_device
    from core.plan.model_spec import load_model_spec
    from core.plan.registry import get_registry
    from core.plan.resolver import resolve

    if args.model_path is None:
        from core.plan.default_model import default_model_path

        args = args.replace(model_path=default_model_path())
    registry = registry or get_registry()
    spec = load_model_spec(args.model_path)
    device = select_device(registry, args.device, args.device_profile)
    return args, resolve(spec, device, args, registry), spec, registry


@dataclass
class EngineCore:
    """Everything the worker loop drives, plus what the client needs to know about it."""

    scheduler: Scheduler
    info: EngineInfo
    loaded: LoadedModel


def geometry_of(spec: ModelSpec, cfg: HFConfig, dtype_bytes: int) -> ModelGeometry:
    """What a Platform's memory defaults depend on, from the model spec and its HF config."""
    from core.contract.platform import ModelGeometry

    return ModelGeometry(hidden_size=spec.hidden_size, num_heads=spec.num_heads,
                         num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim,
                         intermediate_size=getattr(cfg, "intermediate_size", None),
                         vocab_size=int(spec.vocab_size), dtype_bytes=dtype_bytes)


@dataclass(frozen=True)
class MemoryPlan:
    """What the KV pool, the request table and the graphs get, and the notes that say why."""

    kv_tokens: int  # usable KV slots (the pool adds one page: the padding sink)
    bytes_per_token: int
    max_running: int
    chunked_prefill_size: int | None  # None: no chunking
    graphs: GraphDecision
    notes: tuple[str, ...]
    # a hybrid KV pool (core.engine.memory.kv_groups): every group (the full one first; then
    # kv_tokens is its usable tokens) and the windowed groups' usable tokens; () when off
    kv_groups: tuple = ()
    group_tokens: tuple[int, ...] = ()


def plan_memory(args: ServerArgs, plan: Plan, spec: ModelSpec, cfg: HFConfig, dtype_bytes: int,
                bytes_per_token: int, free_bytes: int, platform: Platform) -> MemoryPlan:
    """Phase 1, pure given the platform's answers: sizes from the flags, the device's memory
    and the platform's defaults. `free_bytes` is the device's free memory now (0 when
    --max-total-tokens fixes the pool)."""
    from core.engine.graphs import decide as decide_graphs
    from core.engine.graphs import graph_memory_reserve
    from core.engine.memory.memory_pool import kv_pool_tokens

    mem_total = plan.device.memory_bytes or free_bytes
    defaults = platform.memory_defaults(mem_total, geometry_of(spec, cfg, dtype_bytes))
    max_running = args.max_running_requests or defaults.max_running_requests
    # Decode graphs: decided (with a note either way) and their memory reserved before the KV
    # pool takes what is left.
    graphs = decide_graphs(plan.cuda_graph, platform.graphs(), args.cuda_graph_max_bs,
                           defaults.graph_max_bs, max_running)
    free = free_bytes
    if graphs.enabled and args.max_total_tokens is None:
        free = max(free - graph_memory_reserve(graphs.max_bs, spec.vocab_size, spec.hidden_size,
                                               getattr(cfg, "intermediate_size", None),
                                               dtype_bytes), 0)
    tokens, kv_note = kv_pool_tokens(
        max_total_tokens=args.max_total_tokens, mem_fraction_static=args.mem_fraction_static,
        free_bytes=free, total_bytes=mem_total, bytes_per_token=bytes_per_token,
        page_size=plan.page_size, default_fraction=defaults.mem_fraction_static,
        cap_tokens=defaults.kv_cap_tokens)
    chunk = args.chunked_prefill_size
    if chunk is None:
        chunk = defaults.chunked_prefill_size
    return MemoryPlan(tokens, bytes_per_token, max_running, None if chunk < 0 else chunk, graphs,
                      (defaults.note, kv_note))


def kv_bytes_per_token(spec: ModelSpec, kv_heads: int, kv_dtype: torch.dtype) -> int:
    """KV-cache bytes one token takes over all layers: K and V of `kv_heads` heads, or for MLA
    models one latent row of kv_lora_rank + qk_rope_head_dim values (core.contract.mla)."""
    from core.engine.memory.kv_cache import KVPool, MLAKVPool

    if spec.attention_kind == "MLA":
        mla = spec.mla or {}
        return MLAKVPool.bytes_per_token(spec.num_layers, int(mla["kv_lora_rank"]),
                                         int(mla["qk_rope_head_dim"]), kv_dtype)
    return KVPool.bytes_per_token(spec.num_layers, kv_heads, spec.head_dim, kv_dtype,
                                  spec.v_head_dim)


def kv_dtype_of(plan: Plan) -> torch.dtype:
    """The torch dtype of the plan's KV cache (the contract's fp8 names map to torch's)."""
    import torch

    name = {"fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}.get(
        plan.kv_cache_dtype, plan.kv_cache_dtype)
    kv_dtype = getattr(torch, name, None)
    if kv_dtype is None:
        raise ValueError(f"KV-cache dtype {plan.kv_cache_dtype!r} is not supported by this engine")
    return kv_dtype


def build_kv(plan: Plan, spec: ModelSpec, mem: MemoryPlan, kv_dtype: torch.dtype,
             device: torch.device, max_context: int, loaded: LoadedModel,
             kv_heads: int | None = None, platform: Platform | None = None
             ) -> tuple[KVPool | MLAKVPool, ReqToTokenPool]:
    """Phase 2: the paged KV pool (writing through the layer ops' store, its buffers from the
    platform) and the request table. kv_heads: the KV heads this rank holds (default: the
    model's)."""
    from core.engine.memory.kv_cache import KVPool, MLAKVPool, checkpoint_kv_scales
    from core.engine.memory.memory_pool import ReqToTokenPool

    page = plan.page_size
    k_scale, v_scale = checkpoint_kv_scales(loaded.model, kv_dtype, loaded.notes)
    # One extra page: page 0 is the padding sink, so `kv_tokens` stay usable.
    if spec.attention_kind == "MLA":  # one latent row per token (core.contract.mla)
        mla = spec.mla or {}
        pool = MLAKVPool(mem.kv_tokens + page, spec.num_layers, int(mla["kv_lora_rank"]),
                         int(mla["qk_rope_head_dim"]), kv_dtype, device, page,
                         platform=platform)
        return pool, ReqToTokenPool(mem.max_running, max_context, device)
    kv_heads = spec.num_kv_heads if kv_heads is None else kv_heads
    store = loaded.ops.store_kv() if loaded.ops is not None else None
    kv_pool = KVPool(mem.kv_tokens + page, spec.num_layers, kv_heads, spec.head_dim,
                     kv_dtype, device, page, spec.v_head_dim, k_scale=k_scale, v_scale=v_scale,
                     store=store, platform=platform,
                     layers=mem.kv_groups[0].layers if mem.kv_groups else None)
    return kv_pool, ReqToTokenPool(mem.max_running, max_context, device,
                                   groups=max(1, len(mem.kv_groups)))


def build_group_pools(spec: ModelSpec, mem: MemoryPlan, kv_pool: KVPool, kv_heads: int,
                      platform: Platform | None) -> list[KVPool]:
    """A hybrid pool's windowed groups' K/V (like group 0's `kv_pool`, only their layers):
    usable tokens, the padding-sink page and the dummy page last (never written: zeros)."""
    from core.engine.memory.kv_cache import KVPool

    page = kv_pool.page_size
    return [KVPool(tokens + 2 * page, spec.num_layers, kv_heads, spec.head_dim, kv_pool.dtype,
                   kv_pool.device, page, spec.v_head_dim, k_scale=kv_pool.k_scale,
                   v_scale=kv_pool.v_scale, store=kv_pool.store, platform=platform,
                   layers=g.layers)
            for g, tokens in zip(mem.kv_groups[1:], mem.group_tokens, strict=True)]


def plan_hybrid_kv(args: ServerArgs, spec: ModelSpec, mem: MemoryPlan, plan_again: Callable[
        [int], MemoryPlan], layer_bytes: int, max_context: int, ps: int) -> MemoryPlan:
    """The hybrid KV pool's layout (core.engine.memory.kv_groups), or `mem` as it is with a
    note saying why not. plan_again(bytes_per_token): plan_memory at another per-token cost
    (a full-group token with its windowed share). layer_bytes: one token's K+V in one layer;
    ps: the page size. A windowed group is never smaller than one request's peak there, which
    may take it past the budget's share on a tiny pool (the note gives the sizes)."""
    from core.engine.memory.kv_groups import (
        group_tokens,
        hybrid_reason,
        kv_groups,
        split_budget_bytes_per_token,
    )

    try:
        groups = kv_groups(spec.sliding_windows, spec.num_layers)
        why = hybrid_reason(groups, spec.attention_kind == "MLA")
    except ValueError as exc:  # a spec whose windows do not match its layers
        groups, why = (), str(exc)
    if why is not None:
        if spec.has_sliding_window:  # say why windows only mask here
            mem = dataclasses.replace(mem, notes=(*mem.notes, f"hybrid KV pool off: {why}"))
        return mem
    if args.disable_hybrid_kv:
        return dataclasses.replace(mem, notes=(*mem.notes, "hybrid KV pool off: "
                                               "--disable-hybrid-kv"))
    ratio = args.swa_full_tokens_ratio
    per_token = split_budget_bytes_per_token(groups, layer_bytes, ratio)
    mem = plan_again(math.ceil(per_token))
    full = mem.kv_tokens
    chunk = mem.chunked_prefill_size or max_context
    tokens = []
    for g in groups[1:]:
        # never less than one request's peak there: its window, a page, the extend in flight
        floor = min(full, g.window + chunk + 2 * ps)
        tokens.append(max(group_tokens(full, ratio, ps),
                          -(-floor // ps) * ps))
    lines = [f"{g.describe()}: {t} tokens" for g, t in
             zip(groups, (full, *tokens), strict=True)]
    note = (f"hybrid KV pool (--swa-full-tokens-ratio {ratio}): " + "; ".join(lines)
            + f"; {per_token:.0f} B per full-context token (all layers: "
            f"{layer_bytes * spec.num_layers} B)")
    return dataclasses.replace(mem, kv_groups=groups, group_tokens=tuple(tokens),
                               bytes_per_token=int(per_token), notes=(*mem.notes, note))


def build_lora(args: ServerArgs, plan: Plan, loaded: LoadedModel, registry: Registry,
               device: torch.device) -> tuple[LoRAManager, list[str]]:
    """The plan's LoRA backend and the adapters named at start, attached to the model's
    projections: the largest rank and the target modules the flags left open come from those
    adapters. An adapter that cannot be served stops the start with its reason."""
    from core.contract.lora import LoRABackend, LoRAConfig
    from core.engine.lora import LoRAManager, read_config
    from core.plan.lora import DEFAULT_MAX_RANK, adapter_specs

    specs = adapter_specs(args)
    configs = [read_config(s.name, s.path) for s in specs]
    supported = {m.rsplit(".", 1)[-1] for m in loaded.model.lora_targets()}
    max_rank = plan.lora_max_rank or max((int(c["r"]) for c in configs),
                                         default=DEFAULT_MAX_RANK)
    targets = set(plan.lora_target_modules)
    if not targets:
        for c in configs:
            tm = c.get("target_modules")
            targets |= ({t.rsplit(".", 1)[-1] for t in tm if isinstance(t, str)}
                        & supported if isinstance(tm, list) else supported)
        targets = targets or supported
    reg = registry.get("lora", plan.lora_backend)
    if reg is None:
        raise ValueError(f"LoRA backend {plan.lora_backend!r} is not registered")
    backend = reg.load()(LoRAConfig(num_slots=plan.lora_slots, max_rank=max_rank,
                                    dtype=loaded.dtype, device=device))
    if not isinstance(backend, LoRABackend):
        raise TypeError(f"LoRA backend {plan.lora_backend!r} from {reg.origin.describe()} does "
                        "not implement prepare / apply (core.contract.lora.LoRABackend)")
    manager = LoRAManager(loaded.model, backend, plan.lora_slots, max_rank, targets,
                          loaded.dtype, device, graph_safe=reg.caps.graph_safe)
    for s in specs:
        manager.load(s.name, s.path)
    return manager, [f"LoRA: {plan.lora_backend}, {plan.lora_slots} slot(s), rank up to "
                     f"{max_rank}, on {', '.join(sorted(targets))}; adapters "
                     f"{', '.join(s.name for s in specs) or 'none yet'}"]


def build_runner(plan: Plan, spec: ModelSpec, registry: Registry, platform: Platform,
                 loaded: LoadedModel, kv_pool: KVPool | MLAKVPool, req_to_token: ReqToTokenPool,
                 kv_dtype: torch.dtype, device: torch.device, max_context: int,
                 mem: MemoryPlan, heads: int | None = None, kv_heads: int | None = None,
                 group_pools: list[KVPool] | None = None,
                 args: ServerArgs | None = None) -> tuple[ModelRunner, str]:
    """Phase 3: attention backends, the model runner (the platform's post-load transform runs
    here), LoRA adapters (with `args`, where the plan serves them), decode graphs, startup
    compilation. Returns (runner, graph note). heads, kv_heads: what this rank holds (default:
    the model's). group_pools: a hybrid pool's windowed groups (each gets backend instances of
    its own: their per-step state is per table)."""
    from core.contract.attention import BackendContext
    from core.engine.graphs import capture_graphs
    from core.engine.model_runner import ModelRunner, make_backends

    ctx = BackendContext(num_heads=spec.num_heads if heads is None else heads,
                         num_kv_heads=spec.num_kv_heads if kv_heads is None else kv_heads,
                         head_dim=spec.head_dim, num_layers=spec.num_layers,
                         dtype=loaded.dtype, kv_dtype=kv_dtype, device=device,
                         page_size=plan.page_size, max_context_len=max_context)
    prefill, decode = make_backends(registry, plan.prefill_attention, plan.decode_attention, ctx)
    group_pools = group_pools or []
    layer_group = None
    if group_pools:
        layer_group = [0] * spec.num_layers
        for g, group in enumerate(mem.kv_groups):
            for i in group.layers:
                layer_group[i] = g
    runner = ModelRunner(loaded.model, kv_pool, req_to_token, prefill, decode, device, platform,
                         group_pools=group_pools,
                         group_backends=[make_backends(registry, plan.prefill_attention,
                                                       plan.decode_attention, ctx)
                                         for _ in group_pools],
                         layer_group=layer_group,
                         group_windows=[g.window for g in mem.kv_groups[1:]]
                         if group_pools else ())
    if plan.lora_backend is not None:
        runner.lora, lora_notes = build_lora(args or ServerArgs(), plan, loaded, registry,
                                             device)
        runner.notes += lora_notes
    graph_note = capture_graphs(runner, mem.graphs, int(loaded.hf_config.vocab_size), platform)
    runner.verify_graphs = plan.spec_verify_graphs
    # Compile the prefill kernels' common variants now (where the platform says it pays):
    # seconds at startup instead of in the first requests.
    runner.warmup(platform.warmup_shapes())
    return runner, graph_note


def build_scheduler(args: ServerArgs, plan: Plan, runner: ModelRunner,
                    req_to_token: ReqToTokenPool, mem: MemoryPlan, platform: Platform,
                    loaded: LoadedModel, max_context: int, device: torch.device,
                    registry: Registry | None = None, draft: DraftModelRunner | None = None
                    ) -> tuple[Scheduler, set[int], tuple[str, ...]]:
    """Phase 4: pages, prefix cache, sampler, the grammar backend, the speculative proposer
    (given `draft`, the draft model, where it runs one) and the scheduler. Returns
    (scheduler, EOS ids, notes: the overlap schedule's, the proposer's)."""
    from core.contract.grammar import make_grammar
    from core.engine.grammar_compiler import CompilerSpec, CompileService
    from core.engine.memory.memory_pool import PageAllocator
    from core.engine.memory.radix_cache import make_prefix_cache
    from core.engine.sampling import Sampler
    from core.engine.scheduler import Scheduler, SchedulerConfig

    page = plan.page_size
    allocator = PageAllocator((mem.kv_tokens + page) // page, page)
    # a hybrid pool's windowed groups: usable pages, the sink page 0, the dummy page last
    group_allocators = [PageAllocator(n, page, dummy_page=n) for n in
                        ((t + page) // page for t in mem.group_tokens)]
    windows = [g.window for g in mem.kv_groups[1:]]
    cache = make_prefix_cache(allocator, page, args.disable_radix_cache,
                              args.radix_eviction_policy, windows, group_allocators)
    overlap, overlap_note = platform.overlap_schedule()
    if args.disable_overlap_schedule:
        overlap, overlap_note = False, "overlap schedule off: --disable-overlap-schedule"
    elif plan.spec_proposer is not None and overlap:
        overlap, overlap_note = False, ("overlap schedule off: speculative decoding "
                                        "(--speculative-algorithm) verifies each step's "
                                        "drafts before proposing the next")
    sched_cfg = SchedulerConfig(
        page_size=page, max_context=max_context, max_running_requests=mem.max_running,
        max_queued_requests=args.max_queued_requests,
        chunked_prefill_size=mem.chunked_prefill_size,
        max_prefill_tokens=args.max_prefill_tokens, schedule_policy=args.schedule_policy,
        enable_priority_scheduling=args.enable_priority_scheduling,
        priority_preemption_threshold=args.priority_scheduling_preemption_threshold,
        schedule_conservativeness=args.schedule_conservativeness, seed=args.seed,
        overlap=overlap,
        jump_forward=args.enable_jump_forward and plan.grammar_backend is not None,
        spec_draft_tokens=plan.spec_draft_tokens,
        spec_governor=plan.spec_governor,
        spec_disable_batch=args.speculative_disable_by_batch_size,
        decode_itl_target_ms=args.decode_itl_target_ms)
    tok, cfg = loaded.tokenizer, loaded.hf_config
    eos = set(tok.eos_token_ids) if tok is not None else set()
    cfg_eos = getattr(cfg, "eos_token_id", None)
    eos |= set(cfg_eos if isinstance(cfg_eos, (list, tuple)) else
               [cfg_eos] if cfg_eos is not None else [])
    grammar = None
    if plan.grammar_backend is not None and tok is not None:
        if registry is None:
            from core.plan.registry import get_registry

            registry = get_registry()
        # built on first use, or in the background once serving (Grammar.prepare): its
        # library's import (~1 s: xgrammar imports transformers) is not on the start's path
        grammar = make_grammar(registry, plan.grammar_backend, tok, int(cfg.vocab_size),
                               sorted(eos), lazy=True)
        # client input reaches the grammar library only in compile processes, with a deadline
        grammar.compiler = CompileService(
            grammar, CompilerSpec(args_to_json(args), plan.grammar_backend,
                                  int(cfg.vocab_size), tuple(sorted(eos))),
            workers=GRAMMAR_COMPILE_PROCESSES, timeout_s=args.grammar_compile_timeout)
    proposer, spec_grammars, notes = None, False, [overlap_note]
    if plan.spec_proposer is not None:
        proposer, spec_grammars = make_proposer(args, plan, int(cfg.vocab_size), registry,
                                                draft)
        said = getattr(proposer, "notes", None)  # optional: what the proposer chose
        if callable(said):
            notes += [str(n) for n in said()]
    scheduler = Scheduler(runner, allocator, req_to_token, cache,
                          Sampler(device, args.seed, to_device=platform.to_device),
                          sched_cfg, eos, int(cfg.vocab_size),
                          decode_text=tok.decode if tok is not None else None, grammar=grammar,
                          proposer=proposer, proposer_grammars=spec_grammars,
                          windows=windows, group_allocators=group_allocators,
                          lora=runner.lora)
    if scheduler.spec is not None:
        scheduler.spec.draft = draft  # its pool's accounting and stats
    notes.append(scheduler.budget.note())
    return scheduler, eos, tuple(notes)


def make_proposer(args: ServerArgs, plan: Plan, vocab_size: int,
                  registry: Registry | None = None, draft: DraftModelRunner | None = None
                  ) -> tuple[Proposer, bool]:
    """The plan's speculative proposer built from the --speculative-* flags (and the engine's
    draft model, for one whose caps need draft weights), and whether it checks drafts against
    grammars (SpecCaps.grammars)."""
    from core.contract import spec as contract

    if registry is None:
        from core.plan.registry import get_registry

        registry = get_registry()
    reg = registry.get("spec", plan.spec_proposer)
    if reg is None:
        raise ValueError(f"speculative proposer {plan.spec_proposer!r} is not registered")
    if reg.caps.needs_draft_weights and draft is None:
        raise ValueError(f"speculative proposer {plan.spec_proposer!r} needs a draft model "
                         "(--speculative-draft-model-path)")
    config = contract.SpecConfig(num_draft_tokens=plan.spec_draft_tokens,
                        min_match=args.speculative_ngram_min_match_window_size,
                        max_match=args.speculative_ngram_max_match_window_size,
                        vocab_size=vocab_size,
                        draft=draft if reg.caps.needs_draft_weights else None)
    proposer = reg.load()(config)
    if not isinstance(proposer, contract.Proposer):
        raise TypeError(f"speculative proposer {plan.spec_proposer!r} from "
                        f"{reg.origin.describe()} does not implement propose / observe / reset "
                        "(core.contract.spec.Proposer)")
    return proposer, reg.caps.grammars


@dataclass
class LoadedDraft:
    """The draft model of a draft-model proposer, loaded, with what its KV pool needs."""

    loaded: LoadedModel
    spec: ModelSpec
    kv_dtype: torch.dtype
    bytes_per_token: int
    notes: tuple[str, ...]


def load_draft(args: ServerArgs, plan: Plan, registry: Registry, device: torch.device,
               target: LoadedModel) -> LoadedDraft:
    """Load plan.spec_draft's model with the engine's loader (the draft's own load format and
    quant method) and check that it shares the target's tokenizer: every token of the
    target's vocabulary must have the same id in the draft's (ValueError naming a few that do
    not)."""
    from core.engine.loader import load_model
    from core.plan.model_spec import load_model_spec
    from core.plan.resolver import draft_server_args

    dplan = plan.spec_draft
    dargs = draft_server_args(args, dplan.dtype, dplan.page_size)
    loaded = load_model(dargs, dplan, registry, device=device)
    notes = [f"draft model: {n}" for n in loaded.notes]
    why = tokenizers_differ(target.tokenizer, loaded.tokenizer)
    if why is not None:
        raise ValueError(f"--speculative-draft-model-path {dargs.model_path}: the draft does not "
                         f"share the target's tokenizer: {why}")
    if target.tokenizer is None or loaded.tokenizer is None:
        notes.append("draft model: tokenizers not compared (one model has none); only the "
                     "vocabulary sizes were")
    dspec = load_model_spec(dargs.model_path)
    kv_dtype = kv_dtype_of(dplan)
    return LoadedDraft(loaded, dspec, kv_dtype, kv_bytes_per_token(dspec, dspec.num_kv_heads,
                                                                    kv_dtype), tuple(notes))


def tokenizers_differ(target: Any, draft: Any) -> str | None:
    """Why the draft's tokenizer is not the target's (token ids differ), or None (the same,
    or one of them missing)."""
    if target is None or draft is None:
        return None
    a, b = target.hf.get_vocab(), draft.hf.get_vocab()
    wrong = sorted((i, t) for t, i in a.items() if b.get(t) != i)
    if not wrong:
        return None
    shown = ", ".join(f"{t!r} is {i} in the target's, {b.get(t)} in the draft's"
                      for i, t in wrong[:3])
    return f"{len(wrong)} of the target's {len(a)} tokens differ ({shown})"


def build_draft_runner(draft: LoadedDraft, plan: Plan, registry: Registry, platform: Platform,
                       mem: MemoryPlan, device: torch.device, max_context: int,
                       target_vocab: int) -> DraftModelRunner:
    """The draft's model runner over a KV pool of its own: the target's tokens, plus room for
    every running request's drafts and a partly filled page, plus the padding-sink page."""
    from core.contract.attention import BackendContext
    from core.engine.draft import DraftModelRunner
    from core.engine.memory.kv_cache import KVPool, MLAKVPool
    from core.engine.memory.memory_pool import PageAllocator, ReqToTokenPool
    from core.engine.model_runner import ModelRunner, make_backends

    dplan, dspec, loaded = plan.spec_draft, draft.spec, draft.loaded
    page = dplan.page_size
    tokens = mem.kv_tokens + mem.max_running * (plan.spec_draft_tokens + 1 + page)
    pages = -(-tokens // page) + 1
    context = min(max_context, int(getattr(loaded.hf_config, "max_position_embeddings", None)
                                   or dspec.context_length))
    if dspec.attention_kind == "MLA":
        mla = dspec.mla or {}
        pool = MLAKVPool(pages * page, dspec.num_layers, int(mla["kv_lora_rank"]),
                         int(mla["qk_rope_head_dim"]), draft.kv_dtype, device, page,
                         platform=platform)
    else:
        pool = KVPool(pages * page, dspec.num_layers, dspec.num_kv_heads, dspec.head_dim,
                      draft.kv_dtype, device, page, dspec.v_head_dim,
                      store=loaded.ops.store_kv() if loaded.ops is not None else None,
                      platform=platform)
    table = ReqToTokenPool(mem.max_running, context, device)
    ctx = BackendContext(num_heads=dspec.num_heads, num_kv_heads=dspec.num_kv_heads,
                         head_dim=dspec.head_dim, num_layers=dspec.num_layers,
                         dtype=loaded.dtype, kv_dtype=draft.kv_dtype, device=device,
                         page_size=page, max_context_len=context)
    prefill, decode = make_backends(registry, dplan.prefill_attention, dplan.decode_attention,
                                    ctx)
    runner = ModelRunner(loaded.model, pool, table, prefill, decode, device, platform)
    runner.warmup(platform.warmup_shapes())
    return DraftModelRunner(runner, PageAllocator(pages, page), table,
                            min(target_vocab, int(loaded.hf_config.vocab_size)),
                            max_extend=mem.chunked_prefill_size or 512)


@dataclass
class Ranks:
    """This worker's place among the tensor-parallel ranks of its engine (None of it when the
    engine is one process without torch.distributed)."""

    spec: RankSpec
    tp: TPGroup
    comm: torch.device  # where the worker's own collectives run (Platform.dist_device)

    def share(self, msgs: list[Message] | None) -> list[Message]:
        """Rank 0's messages of this loop turn, on every rank (rank 0 passes them, the others
        None): JSON lines in one broadcast."""
        from core.engine.distributed import broadcast_bytes

        data = None if msgs is None else b"\n".join(encode(m) for m in msgs)
        got = broadcast_bytes(data, self.comm)
        return [] if not got else [decode(line) for line in got.split(b"\n")]

    def leave(self) -> None:
        """Leave the process group before the interpreter ends: left to the exit, the group's
        native threads can outlive its teardown and abort the process ("terminate called
        without an active exception", seen on a rank of node 1 in CI)."""
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception as exc:  # noqa: BLE001 - leaving is best-effort; say why
                print(f"core: rank {self.spec.rank}: leaving the process group: {exc}",
                      file=sys.stderr, flush=True)


def join_ranks(spec: RankSpec, payload: bytes | None) -> tuple[Ranks, bytes]:
    """Join the process group of `spec` and share rank 0's args and plan (`payload`, JSON;
    None on the other ranks, which may be on another node and know nothing yet)."""
    import torch

    from core.contract.platform import load_platform
    from core.engine.distributed import TPGroup, broadcast_bytes, init_process_group
    from core.plan.registry import get_registry

    registry = get_registry()  # the rank knows its target, not yet the plan
    platform = load_platform(registry, registry.probe(spec.target))
    device = torch.device(spec.device)
    init_process_group(spec, platform, device)
    comm = platform.dist_device(device)
    payload = broadcast_bytes(payload, comm)
    got = json.loads(payload)
    ep = json.loads(got["args"]).get("ep_size", 1) > 1
    tp = TPGroup(rank=spec.rank, size=spec.world, ep=ep, group=torch.distributed.group.WORLD)
    return Ranks(spec, tp, comm), payload


def local_heads(spec: ModelSpec, tp: TPGroup) -> tuple[int, int]:
    """(query heads, KV heads) one rank holds."""
    return tp.split(spec.num_heads, "attention heads")[1], tp.kv_heads(spec.num_kv_heads)[1]


def build_engine_core(args: ServerArgs, plan: Plan, spec: ModelSpec, registry: Registry,
                      loaded: LoadedModel | None = None, ranks: Ranks | None = None,
                      device_index: int = 0, progress: Callable[[str], None] | None = None,
                      slot: int = 0, phases_before: Sequence[tuple[str, float]] = ()
                      ) -> EngineCore:
    """Load (unless given), then the four phases: memory, KV, runner, scheduler. `ranks`:
    this worker's tensor-parallel place (its device index, its slice of the model, a KV pool
    for its heads, sized the same on every rank); `device_index`: the device of a worker
    without ranks (a data-parallel replica's); `slot`: its place among this node's engine
    processes, where they share a device's cores (a rank's is in its RankSpec).
    progress(line): called as each phase ends (what it did and its seconds; `core serve`
    prints them, STARTUP_PROGRESS_ENV). phases_before: the process's phases before this call
    (a prestarted worker's imports, its read-ahead, its wait for the plan), reported first."""
    t_phase = [time.monotonic()]
    # (what, seconds): EngineInfo.startup_phases
    phases: list[tuple[str, float]] = [(what, round(sec, 3)) for what, sec in phases_before]
    if progress is not None:
        for what, sec in phases:
            progress(f"{what} ({sec:.1f} s)")

    def done(what: str) -> None:
        now = time.monotonic()
        phases.append((what, round(now - t_phase[0], 3)))
        if progress is not None:
            progress(f"{what} ({now - t_phase[0]:.1f} s)")
        t_phase[0] = now

    import torch

    from core.contract.platform import load_platform
    from core.engine.distributed import SINGLE, all_min, share_threads
    from core.engine.loader import load_model

    if plan.device.simulated:
        raise ValueError(f"cannot run on a simulated device ({plan.device.describe()}); "
                         f"drop --device-profile to run here")
    platform = load_platform(registry, plan.device)
    index = ranks.spec.local_index if ranks is not None else device_index
    tp = ranks.tp if ranks is not None else SINGLE
    device = torch.device(platform.torch_device(index))
    # The engine processes of this node (ranks x replicas) and how many share one device
    # (all of them on a CPU target): they split its cores and its free memory.
    here = args.tp_size // args.nnodes * args.dp_size
    sharing = max(1, -(-here // max(plan.device.count, 1)))
    threads_note = share_threads(sharing, ranks.spec.slot if ranks is not None else slot)
    if loaded is None:
        loaded = load_model(args, plan, registry, device=device, tp=tp)
        done(f"weights loaded ({plan.quant_method} on {device})")
    cfg = loaded.hf_config
    max_context = int(getattr(cfg, "max_position_embeddings", None) or spec.context_length)
    kv_dtype = kv_dtype_of(plan)
    heads, kv_heads = local_heads(spec, tp)
    per_token = kv_bytes_per_token(spec, kv_heads, kv_dtype)
    draft = None
    if plan.spec_draft is not None:  # loaded before the KV budget is taken from what is free
        draft = load_draft(args, plan, registry, device, loaded)
        done(f"draft model loaded ({plan.spec_draft.quant_method} on {device})")
    draft_per_token = draft.bytes_per_token if draft is not None else 0
    free_now = platform.memory(index)[0] // sharing if args.max_total_tokens is None else 0

    def plan_at(bytes_per_token: int) -> MemoryPlan:
        # the draft's KV pool holds as many tokens as the target's: one budget for both
        return plan_memory(args, plan, spec, cfg, loaded.dtype.itemsize,
                           bytes_per_token + draft_per_token, free_now, platform)

    mem = plan_hybrid_kv(args, spec, plan_at(per_token), plan_at,
                         per_token // max(spec.num_layers, 1), max_context, plan.page_size)
    if draft is not None:  # the target's own cost per token (the draft's pool says its own)
        mem = dataclasses.replace(mem, bytes_per_token=mem.bytes_per_token - draft_per_token
                                  if not mem.kv_groups else mem.bytes_per_token)
    per_token = mem.bytes_per_token
    notes: tuple[str, ...] = ()
    if ranks is not None:  # every rank schedules alike: one pool size, the smallest
        mem = dataclasses.replace(mem, kv_tokens=all_min(mem.kv_tokens, ranks.comm),
                                  group_tokens=tuple(all_min(t, ranks.comm)
                                                     for t in mem.group_tokens))
        kv_part = ("the whole MLA latent cache (replicated)" if spec.attention_kind == "MLA"
                   else f"{kv_heads} of {spec.num_kv_heads} KV heads")
        notes = (f"tensor parallel: rank {tp.rank} of {tp.size} ({ranks.spec.backend}), "
                 f"{heads} of {spec.num_heads} heads and {kv_part} per rank",)
    done(f"memory planned: KV cache {mem.kv_tokens} tokens")
    kv_pool, req_to_token = build_kv(plan, spec, mem, kv_dtype, device, max_context, loaded,
                                     kv_heads, platform)
    group_pools = build_group_pools(spec, mem, kv_pool, kv_heads, platform) \
        if mem.kv_groups else []
    done(f"KV cache allocated ({mem.kv_tokens * per_token / 2**20:.0f} MiB)")
    runner, graph_note = build_runner(plan, spec, registry, platform, loaded, kv_pool,
                                      req_to_token, kv_dtype, device, max_context, mem,
                                      heads, kv_heads, group_pools, args)
    done("model runner ready (kernels built, warmed up)")
    draft_runner = None
    if draft is not None:
        draft_runner = build_draft_runner(draft, plan, registry, platform, mem, device,
                                          max_context, int(cfg.vocab_size))
        pool_tokens = draft_runner.allocator.total_pages * plan.spec_draft.page_size
        notes = (*notes, *draft.notes, (
            f"draft model KV cache {pool_tokens} tokens ({draft_per_token} B/token, "
            f"{pool_tokens * draft_per_token / 2**20:.0f} MiB): the target's tokens and "
            f"{plan.spec_draft_tokens} drafts per running request"))
        done(f"draft model runner ready (KV cache {pool_tokens} tokens)")
    scheduler, eos, sched_notes = build_scheduler(args, plan, runner, req_to_token, mem,
                                                   platform, loaded, max_context, device,
                                                   registry, draft_runner)
    done("scheduler ready")
    startup = ("start-up of the engine process: "
               + "; ".join(f"{what} {sec:.1f} s" for what, sec in phases)
               + f"; {sum(sec for _, sec in phases):.1f} s in all (the decode graphs' capture "
               "is part of the model runner's; its note gives its own time)")
    info = EngineInfo(
        max_context=max_context, pool_tokens=scheduler.allocator.total_pages * plan.page_size,
        page_size=plan.page_size, max_running_requests=mem.max_running,
        vocab_size=int(cfg.vocab_size), eos_token_ids=tuple(sorted(eos)),
        chunked_prefill_size=mem.chunked_prefill_size, kv_bytes_per_token=per_token,
        notes=(*loaded.notes, *notes, *runner.notes, *mem.notes, graph_note, *sched_notes,
               *((threads_note,) if threads_note else ()), startup),
        cuda_graph_batch_sizes=tuple(sorted(runner.graph_runner.graphs))
        if runner.graph_runner is not None else (),
        device=str(device), pid=os.getpid(), startup_phases=tuple(phases))
    return EngineCore(scheduler, info, loaded)


def _item(req: Req) -> OutputItem:
    lps = None
    if req.params.logprobs:
        lps = tuple(TokenLogprob(lp, tuple(top)) for lp, top in req.pending_lps)
    plps = None
    if req.params.prompt_logprobs is not None and not req.prompt_lps_sent \
            and not req.wants_prompt_lps:  # all computed (an abort before then sends none)
        plps = tuple(TokenLogprob(lp, tuple(top), rank) for lp, top, rank in req.prompt_lps)
        req.prompt_lps_sent = True
    spec: dict[str, int | str | None] = {}
    if req.finish is not None and (req.spec_verify_steps or req.spec_note):
        spec = {"spec_verify_ct": req.spec_verify_steps, "spec_draft_tokens": req.spec_drafts,
                "spec_accepted_tokens": req.spec_accepted, "spec_note": req.spec_note}
    out = OutputItem(req.rid, tuple(req.pending_ids), lps,
                     None if req.finish is None else Finish(**req.finish),
                     len(req.prompt_ids), len(req.output_ids), max(req.cached_tokens, 0), plps,
                     **spec)
    req.pending_ids, req.pending_lps = [], []
    return out


# the result (JSON) has the shape its op gives it: stats' dict, or True
def _rpc(core: EngineCore, op: str, args: dict[str, str] | None = None) -> Any:
    sched = core.scheduler
    if op in ("load_lora", "unload_lora"):
        return _lora_rpc(sched, op, args or {})
    if op == "stats":
        graphs = sched.runner.graph_runner
        return {**sched.stats(), "forward_count": dict(sched.runner.forward_count),
                "graph_replays": graphs.replays if graphs is not None else 0}
    if op == "check_accounting":
        sched.check_accounting()
        return True
    if op == "flush_cache":
        if sched.running or sched.chunked or sched.waiting or sched.inflight is not None:
            raise ValueError("cannot flush the prefix cache while requests are in flight")
        sched.cache.evict(sched.allocator.total_pages)
        return True
    raise ValueError(f"unknown rpc {op!r}")


class _Heartbeat:
    """Sends a Heartbeat every HEARTBEAT_S from a daemon thread, so the client can tell
    a busy worker (one long prefill step) from a dead or wedged one without waiting for a step to
    end. It carries the latest stats the loop published between steps and how long the current
    step has been running."""

    def __init__(self, send: Callable[[Message], None], interval: float = HEARTBEAT_S):
        self.send, self.interval = send, interval
        self.stats: dict[str, object] | None = None  # replaced whole by the loop, never mutated
        self.step_started: float | None = None  # time.monotonic() of the running step
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="core-heartbeat", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():  # not mid-send when the caller sends its last message
            self._thread.join(timeout=2.0)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            started = self.step_started
            try:
                self.send(Heartbeat(self.stats,
                                    0.0 if started is None else time.monotonic() - started))
            except ChannelClosed:
                return


def _lora_rpc(sched: Scheduler, op: str, args: dict[str, str]) -> Any:
    """Load or unload a LoRA adapter between steps; ValueError (nothing changed) when it
    cannot be: LoRA off, a bad adapter, a name taken or unknown, an adapter requests still
    use."""
    manager = getattr(sched, "lora", None)
    if manager is None:
        raise ValueError("LoRA is off in this engine (--enable-lora)")
    name = args.get("name")
    if op == "load_lora":
        adapter = manager.load(name, args.get("path") or "")
        return {"name": adapter.name, "rank": adapter.rank,
                "target_modules": sorted(adapter.kinds)}
    uid = manager.lookup(name)
    users = [r.rid for r in sched.by_id.values() if r.lora_id == uid]
    if users:
        raise ValueError(f"LoRA adapter {name!r} is in use by {len(users)} request(s); unload "
                         "it once they finish")
    manager.unload(name)
    return {"name": name}


def _apply(core: EngineCore, msg: Message, send: Callable[[Message], None] | None) -> bool:
    """Carry out one client message on this rank's scheduler; `send` answers the client (rank
    0), None on the other ranks, which apply the same messages silently. False: shut down."""
    sched = core.scheduler
    if isinstance(msg, AddRequest):
        try:  # validated by the client: only what depends on the scheduler's state
            sched.admit(msg.rid, list(msg.input_ids), msg.params, msg.priority, msg.lora)
        except ValueError as exc:
            if send is not None:  # a refusal (400), or a status the error carries
                status = getattr(exc, "status", 400)
                send(StepOutput((OutputItem(
                    msg.rid, (), None, Finish("abort", message=str(exc), status_code=status),
                    len(msg.input_ids), 0, 0),)))
    elif isinstance(msg, Abort):
        sched.abort(msg.rid)
    elif isinstance(msg, GrammarReady):
        sched.grammar_done(list(msg.ids))
    elif isinstance(msg, PrefillBudget):
        sched.budget.shared = msg.tokens
    elif isinstance(msg, Rpc):
        try:
            reply = Reply(msg.id, True, _rpc(core, msg.op, msg.args))
        except (ValueError, AssertionError) as exc:
            reply = Reply(msg.id, False, error=f"{type(exc).__name__}: {exc}")
        if send is not None:
            send(reply)
    elif isinstance(msg, Shutdown):
        return False
    else:
        raise ValueError(f"the worker does not take {type(msg).__name__} messages")
    return True


def serve(core: EngineCore, chan: Channel, heartbeat_s: float = HEARTBEAT_S,
          ranks: Ranks | None = None) -> None:
    """The worker loop: drain messages, run a step when there is work, send its outputs.
    With tensor-parallel ranks, each turn's messages (possibly none) are broadcast to the
    others before anything is applied, so every rank's scheduler takes the same steps; the
    broadcast comes at least every idle poll (0.5 s), which also tells the ranks rank 0
    lives."""
    sched = core.scheduler
    parent = os.getppid()
    lock = threading.Lock()  # the heartbeat thread sends on the same pipe
    budget = getattr(sched, "budget", None)  # (a test's stand-in scheduler has none)
    if ranks is not None:  # rank 0 says when compiles are done, so all ranks agree
        sched.grammar_by_message = True
        if budget is not None:  # and which prefill budget the steps take (its clock's)
            budget.by_message = True
    shared = None  # the prefill budget the ranks were last told (rank 0's clock decides it)

    def send(msg: Message) -> None:
        with lock:
            chan.send(msg)

    grammar = getattr(sched, "grammar", None)  # (a test's stand-in scheduler has none)
    if grammar is not None:
        grammar.prepare()
    beat = _Heartbeat(send, heartbeat_s)
    beat.stats = _rpc(core, "stats")
    published = time.monotonic()
    beat.start()
    try:
        while True:
            timeout = sched.poll_timeout()
            msgs: list[Message] = []
            while chan.poll(timeout):
                timeout = 0.0
                msgs.append(chan.recv())
            if ranks is not None:
                done = sched.grammar_ready()
                if done:
                    msgs.append(GrammarReady(tuple(done)))
                if budget is not None and budget.on:
                    cap = budget.computed()
                    if cap != shared:
                        msgs.append(PrefillBudget(cap))
                        shared = cap
            orphaned = not sched.has_work and not msgs and os.getppid() != parent
            if orphaned:  # the client died without a shutdown: the ranks stop too
                msgs.append(Shutdown())
            if ranks is not None:
                ranks.share(msgs)
            for msg in msgs:
                if not _apply(core, msg, send):
                    return
            if sched.has_work:
                beat.step_started = time.monotonic()
                touched = sched.step()
                beat.step_started = None
                if touched:
                    send(StepOutput(tuple(_item(r) for r in touched)))
            now = time.monotonic()
            if now - published >= SNAPSHOT_S:
                beat.stats, published = _rpc(core, "stats"), now
    finally:
        beat.stop()
        if grammar is not None:
            grammar.close()  # its compile processes


def follow(core: EngineCore, ranks: Ranks) -> None:
    """The loop of a rank other than 0: apply rank 0's messages of each turn, take the same
    step (its outputs are rank 0's to send: they are made and dropped, so per-request state
    moves on alike)."""
    sched = core.scheduler
    sched.grammar_by_message = True
    sched.budget.by_message = True  # rank 0's PrefillBudget messages
    sched.budget.measures = False
    grammar = getattr(sched, "grammar", None)
    try:
        while True:
            for msg in ranks.share(None):
                if not _apply(core, msg, None):
                    return
            if sched.has_work:
                for r in sched.step():
                    _item(r)
    finally:
        if grammar is not None:
            grammar.close()  # its compile processes


def plan_from_parent(args_json: str, plan_json: str
                     ) -> tuple[ServerArgs, Plan, ModelSpec, Registry]:
    """(args, plan, model spec, registry) from what the parent sent: its plan is rebuilt from
    data, not resolved again; plugins load here as in every process (idempotent)."""
    from core.plan.model_spec import load_model_spec
    from core.plan.registry import get_registry

    args = make_server_args(**json.loads(args_json))
    plan = Plan.from_dict(json.loads(plan_json))
    return args, plan, load_model_spec(args.model_path), get_registry()


STARTUP_PROGRESS_ENV = "CORE_STARTUP_PROGRESS"  # "1": print a line per start-up phase


def _progress_printer(args: ServerArgs) -> Callable[[str], None] | None:
    """The worker's start-up progress, one line per phase on its stderr (the terminal of
    `core serve`, which sets STARTUP_PROGRESS_ENV; `core generate --verbose` too); None when
    the environment does not ask for it (the offline Engine, tests)."""
    if os.environ.get(STARTUP_PROGRESS_ENV) != "1":
        return None
    who = "core: engine" + (f" (worker {os.getpid()})" if args.dp_size > 1 else "")

    def show(line: str) -> None:
        print(f"{who}: {line}", file=sys.stderr, flush=True)

    return show


def worker_main(conn: Connection, args_json: str, plan_json: str, rank_json: str | None = None,
                device_index: int = 0, slot: int = 0,
                phases_before: Sequence[tuple[str, float]] = ()) -> None:
    """Entry of the spawned worker process (rank 0 of its engine): the parent's args (model
    path filled in) and its resolved plan, both JSON; `rank_json` (core.engine.distributed.RankSpec)
    when the engine spans tensor-parallel ranks, which rank 0 then joins and sends the args
    and plan; `device_index`: the device it runs on otherwise (a data-parallel replica's);
    `slot`: its place among this node's engine processes (share_threads); `phases_before`:
    build_engine_core's."""
    # Ctrl-C reaches the whole process group: the client decides when the worker stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    keep_torchvision_out()  # core.plan.hf_imports: before transformers
    chan = Channel(conn)
    ranks = None
    try:
        args, plan, spec, registry = plan_from_parent(args_json, plan_json)
        if rank_json is not None:
            from core.engine.distributed import RankSpec

            payload = json.dumps({"args": args_json, "plan": plan_json}).encode()
            ranks, _ = join_ranks(RankSpec.from_json(rank_json), payload)
        core = build_engine_core(args, plan, spec, registry, ranks=ranks,
                                 device_index=device_index, progress=_progress_printer(args),
                                 slot=slot, phases_before=phases_before)
    except Exception as exc:  # noqa: BLE001 - reported to the client, which raises it
        try:
            chan.send(Fatal(f"{type(exc).__name__}: {exc}", traceback.format_exc()))
        except ChannelClosed:
            pass
        return
    chan.send(Ready(core.info))
    try:
        serve(core, chan, ranks=ranks)
    except ChannelClosed:
        return
    except Exception as exc:  # noqa: BLE001 - a scheduler bug: tell the client, then exit
        print(traceback.format_exc(), file=sys.stderr)
        try:
            chan.send(Fatal(f"{type(exc).__name__}: {exc}", traceback.format_exc()))
        except ChannelClosed:
            pass
    finally:
        if ranks is not None:
            ranks.leave()


def rank_main(rank_json: str) -> None:
    """Entry of a tensor-parallel rank other than 0 (spawned by the client on node 0, or by
    `core serve --node-rank N` on another node): join the group, take rank 0's args and plan
    from it, build this rank's engine core, and follow rank 0's loop. A failure ends the
    process with the reason on stderr; rank 0 sees its collectives fail and reports it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    keep_torchvision_out()  # core.plan.hf_imports: before transformers
    from core.engine.distributed import RankSpec

    spec = RankSpec.from_json(rank_json)
    try:
        ranks, payload = join_ranks(spec, None)
        got = json.loads(payload)
        args, plan, model_spec, registry = plan_from_parent(got["args"], got["plan"])
        core = build_engine_core(args, plan, model_spec, registry, ranks=ranks)
        follow(core, ranks)
    except Exception as exc:  # noqa: BLE001 - the reason, then a non-zero exit
        print(f"core: tensor-parallel rank {spec.rank} stopped: {type(exc).__name__}: {exc}",
              file=sys.stderr, flush=True)
        traceback.print_exc()
        sys.exit(1)
    ranks.leave()
    # Done: skip the interpreter's teardown. Even after leaving the group, the distributed
    # backend's native threads have at times aborted a loaded box's rank there ("terminate
    # called without an active exception": a clean rank then exits 134, and node 1's
    # `core serve` reports a failure).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def worker_prestarted(conn: Connection, warm_args: str | None = None) -> None:
    """Entry of a worker spawned before the parent has resolved its plan
    (core.frontend.prestart.StartedWorker): import what building the engine needs (torch:
    seconds) and read the model's spec, config and tokenizer as `warm_args` (the parent's
    ServerArgs as JSON, before its plan) name them, while the parent resolves; then read the
    args and plan (one JSON message) and run worker_main."""
    t0 = time.monotonic()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    keep_torchvision_out()  # core.plan.hf_imports: before transformers
    import torch  # noqa: F401

    import core.engine.loader  # noqa: F401
    t1 = time.monotonic()
    if warm_args is not None:
        _warm_up(warm_args)
    t2 = time.monotonic()
    try:
        message = json.loads(conn.recv_bytes().decode())
    except (EOFError, OSError):
        return  # the parent gave up before sending a plan (its resolution failed)
    phases = [("imports (torch, the engine's modules)", t1 - t0),
              ("model read ahead of the plan (spec, config, tokenizer)", t2 - t1),
              ("waited for the plan", time.monotonic() - t2)]
    worker_main(conn, message["args"], message["plan"], message.get("rank"),
                message.get("device_index", 0), message.get("slot", 0), phases)


def _warm_up(args_json: str) -> None:
    """What the worker reads first once the plan comes, read early: the plugin registry, the
    model's spec (plan_from_parent), its config and its tokenizer (the loader), each from its
    cache entry (core.plan.gguf_cache) or built and saved there, with the imports that takes.
    Not with --trust-remote-code (those bypass the caches: nothing to gain, and no checkpoint
    code runs before the plan does). A failure here is dropped: the same calls run again after
    the plan comes and report it there (or the parent's resolution fails first and no plan
    comes)."""
    from core.engine.loader import find_weights, load_config, load_tokenizer
    from core.plan.model_spec import load_model_spec
    from core.plan.registry import get_registry

    try:
        get_registry()
        args = make_server_args(**json.loads(args_json))
        if args.trust_remote_code:
            return
        if args.model_path is None:
            from core.plan.default_model import default_model_path

            args = args.replace(model_path=default_model_path())
        # In this order: on a new machine the server builds the spec first (its plan), so this
        # process builds the config and the tokenizer meanwhile (each part is built by one
        # process, the other waits for it: core.plan.gguf_cache), and then reads the spec.
        # Spec first, it would wait for the server's build and only then start its own
        # transformers import for the config: the two imports in a row, not side by side.
        load_config(find_weights(args.model_path, args.load_format))
        load_tokenizer(args)
        load_model_spec(args.model_path)
    except Exception:  # noqa: BLE001, S110 - reported where it is done for real (above)
        pass


def args_to_json(args: ServerArgs) -> str:
    return json.dumps(dataclasses.asdict(args))


def plan_to_json(plan: Plan) -> str:
    return json.dumps(plan.to_dict())
