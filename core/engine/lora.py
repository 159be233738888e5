"""LoRA adapters in the worker: read and checked from PEFT's files, held in host memory, copied
into a fixed number of device slots (least recently used first out, never one a running
request holds), and attached to the model's projections through their epilogue hook.

Layout and arithmetic are the protocol's (core.contract.lora); the backend adds the deltas.
Per step the model runner tells the manager which slot each request's tokens use
(`begin_step`); every projection's epilogue then reads that step's batch (the linears' bound
callables take x only, so the step reaches them through the manager they were given).

Decode graphs (a graph-safe backend, `graph_safe`): the graph runner opens a device-only step
(`begin_graph_step`) over its static slot row inside the captured forward, so the backend's
prepare and every projection's apply are recorded and replayed with whatever slots the row
holds then. The stacked buffers are allocated once and only ever written in place (`_fill`
copies into a slot's rows, scalings included): a replay reads the adapters resident at the time.

PEFT's files: adapter_config.json (r, lora_alpha, use_rslora, target_modules, ...) and
adapter_model.safetensors with `base_model.model.<module>.lora_A.weight` [r, in] and
`...lora_B.weight` [out, r]; scaling lora_alpha / r (lora_alpha / sqrt(r) with use_rslora).

Tensor parallelism: every rank reads the adapter and keeps its part, split like the base
layer's weight (Linear.rank_rows / rank_inputs): on a column-parallel projection (q/k/v,
gate/up) A whole and B's rows of this rank's outputs (each fused part's rows, GQA's KV heads
and their replicas as the weight has them); on a row-parallel one (o, down) A's columns of this
rank's inputs and B whole. The epilogue runs before the layer's all-reduce, so a row-parallel
rank's partial delta x_r A_r^T B^T is summed with the partial base outputs into x A^T B^T; no
communication of its own. The buffers have the rank's sizes (the linear's own).
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from core.contract.lora import BASE_SLOT, LoRABackend, LoRABatch, LoRAWeights
from core.layers.linear import Linear, reset_bindings

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_KEY = re.compile(r"(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.[^.]+)?\.weight")
# adapter_config.json fields that change the arithmetic, refused unless off
_UNSUPPORTED = {"use_dora": "DoRA (use_dora)", "fan_in_fan_out": "fan_in_fan_out",
                "lora_bias": "lora_bias", "rank_pattern": "per-module ranks (rank_pattern)",
                "alpha_pattern": "per-module alphas (alpha_pattern)",
                "modules_to_save": "modules_to_save (fully trained extra modules)",
                "target_parameters": "target_parameters (adapters on raw parameters)",
                "trainable_token_indices": "trainable_token_indices",
                "layer_replication": "layer_replication", "use_qalora": "QALoRA (use_qalora)",
                "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens)"}


class AdapterError(ValueError):
    """An adapter that cannot be served; the message names the adapter and the problem."""


@dataclass
class HostAdapter:
    """One adapter as read, in host memory: per HF module, A [r, in] and B [out, r]."""

    name: str
    uid: int  # unique per load: the prefix cache keys by it, so a reloaded name never
    # reuses what an earlier adapter of that name computed
    path: str
    rank: int
    scaling: float
    modules: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    @property
    def kinds(self) -> set[str]:
        return {m.rsplit(".", 1)[-1] for m in self.modules}


def read_config(name: str, path: str) -> dict[str, Any]:
    """adapter_config.json of `path`, checked for what this engine can serve."""
    where = f"LoRA adapter {name!r} ({path})"
    file = os.path.join(path, CONFIG_FILE)
    if not os.path.isdir(path):
        raise AdapterError(f"{where}: no such directory")
    if not os.path.isfile(file):
        raise AdapterError(f"{where}: no {CONFIG_FILE} (a PEFT adapter folder holds "
                           f"{CONFIG_FILE} and {WEIGHTS_FILE})")
    try:
        with open(file, encoding="utf-8") as fh:
            cfg = json.load(fh)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise AdapterError(f"{where}: {CONFIG_FILE} is not readable JSON: {exc}") from None
    if not isinstance(cfg, dict):
        raise AdapterError(f"{where}: {CONFIG_FILE} is not a JSON object")
    peft_type = cfg.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        raise AdapterError(f"{where}: peft_type {peft_type!r} is not LORA")
    r, alpha = cfg.get("r"), cfg.get("lora_alpha", cfg.get("r"))
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise AdapterError(f"{where}: {CONFIG_FILE} r must be a positive integer, got {r!r}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise AdapterError(f"{where}: {CONFIG_FILE} lora_alpha must be a number, got {alpha!r}")
    for key, what in _UNSUPPORTED.items():
        if cfg.get(key):
            raise AdapterError(f"{where}: {what} is not supported")
    if cfg.get("bias", "none") not in ("none", None):
        raise AdapterError(f"{where}: bias {cfg.get('bias')!r} is not supported (only none)")
    return cfg


def read_adapter(name: str, path: str, uid: int, targets: Mapping[str, tuple[Linear, str | None]],
                 allowed: set[str], max_rank: int, dtype: torch.dtype) -> HostAdapter:
    """Read and check an adapter against the model's projections (`targets`, HF module name ->
    (linear, shard)), the projections LoRA was set up for (`allowed`, short names) and the
    largest rank; AdapterError naming the problem, before anything is changed."""
    try:
        return _read_adapter(name, path, uid, targets, allowed, max_rank, dtype)
    except (RuntimeError, TypeError) as exc:  # torch on odd tensors (float8 and the like)
        raise AdapterError(f"LoRA adapter {name!r} ({path}): cannot be read: "
                           f"{type(exc).__name__}: {exc}") from None


def _read_adapter(name: str, path: str, uid: int,
                  targets: Mapping[str, tuple[Linear, str | None]], allowed: set[str],
                  max_rank: int, dtype: torch.dtype) -> HostAdapter:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    where = f"LoRA adapter {name!r} ({path})"
    cfg = read_config(name, path)
    r = int(cfg["r"])
    if r > max_rank:
        raise AdapterError(f"{where}: rank {r} is over --max-lora-rank {max_rank}")
    supported = sorted({m.rsplit(".", 1)[-1] for m in targets})
    tm = cfg.get("target_modules")
    if isinstance(tm, list):
        unknown = [t for t in tm if not isinstance(t, str) or t.rsplit(".", 1)[-1]
                   not in supported]
        if unknown:
            raise AdapterError(f"{where}: target module(s) {', '.join(map(str, unknown))} not a "
                               f"projection the base model takes adapters on "
                               f"({', '.join(supported)})")
    file = os.path.join(path, WEIGHTS_FILE)
    if not os.path.isfile(file):
        other = " (only safetensors is read: adapter_model.bin is not)" if os.path.isfile(
            os.path.join(path, "adapter_model.bin")) else ""
        raise AdapterError(f"{where}: no {WEIGHTS_FILE}{other}")
    try:
        tensors = load_file(file)
    except (SafetensorError, OSError, ValueError) as exc:
        raise AdapterError(f"{where}: {WEIGHTS_FILE} is not readable: {exc}") from None
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        m = _KEY.fullmatch(key)
        if m is None:
            raise AdapterError(f"{where}: tensor {key} is not a LoRA A or B weight (embedding "
                               "adapters, DoRA magnitudes and saved modules are not served)")
        pairs.setdefault(m.group("module"), {})[m.group("ab")] = t
    if not pairs:
        raise AdapterError(f"{where}: {WEIGHTS_FILE} holds no LoRA weights")
    modules: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for module, ab in sorted(pairs.items()):
        kind = module.rsplit(".", 1)[-1]
        if module not in targets:
            raise AdapterError(f"{where}: target module {module} is not a projection of the base "
                               f"model (adapters attach to {', '.join(supported)} of its "
                               f"{_layers(targets)} layers)")
        if kind not in allowed:
            raise AdapterError(f"{where}: targets {kind}, not among the LoRA target modules "
                               f"({', '.join(sorted(allowed))}; --lora-target-modules)")
        if set(ab) != {"A", "B"}:
            raise AdapterError(f"{where}: {module} has lora_{'B' if 'A' in ab else 'A'} "
                               "missing")
        a, b = ab["A"], ab["B"]
        linear, shard = targets[module]
        out, inp = linear.full_shard_size(shard), linear.full_input_size
        if a.dim() != 2 or b.dim() != 2 or a.shape != (r, inp) or b.shape != (out, r):
            raise AdapterError(
                f"{where}: {module} has lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}; "
                f"rank {r} on this base needs [{r}, {inp}] and [{out}, {r}]")
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            raise AdapterError(f"{where}: {module} holds non-finite weights")
        # this rank's part, split like the base layer: a column-parallel layer's B keeps the
        # rows its weight keeps (A whole), a row-parallel layer's A the inputs (B whole)
        a, b = linear.rank_inputs(a), linear.rank_rows(b, shard)
        modules[module] = (a.to(dtype).contiguous(), b.to(dtype).contiguous())
    alpha = float(cfg.get("lora_alpha", r))
    scaling = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
    return HostAdapter(name, uid, path, r, scaling, modules)


def _layers(targets: Mapping[str, object]) -> int:
    return len({m.split(".self_attn")[0].split(".mlp")[0] for m in targets})


class _Projection:
    """One linear's stacked buffers and its epilogue: y + the step's adapter deltas."""

    def __init__(self, manager: LoRAManager, weights: LoRAWeights):
        self.manager, self.weights = manager, weights

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        m = self.manager
        if m.batch is None:  # a step of base tokens only
            return y
        return m.backend.apply(x, y, self.weights, m.batch, m.meta)


class LoRAManager:
    """Host adapters, device slots and the per-step batch (see the module doc)."""

    def __init__(self, model: torch.nn.Module, backend: LoRABackend, num_slots: int,
                 max_rank: int, target_modules: set[str], dtype: torch.dtype,
                 device: torch.device, graph_safe: bool = False):
        """graph_safe: the backend's LoRACaps.graph_safe (decode graphs capture its steps)."""
        self.backend, self.num_slots, self.max_rank = backend, num_slots, max_rank
        self.graph_safe = graph_safe
        self.dtype, self.device = dtype, device
        self.targets: dict[str, tuple[Linear, str | None]] = model.lora_targets()
        self.allowed = set(target_modules)
        self.adapters: dict[str, HostAdapter] = {}
        self._uid = 0
        # device slots: the adapter uid in each, holders, last use
        self.slot_uid: list[int | None] = [None] * num_slots
        self.refs = [0] * num_slots
        self.used = [0] * num_slots
        self.ranks = [0] * num_slots
        self._tick = 0
        self.loads = 0  # adapters copied into a slot (stats)
        self.batch: LoRABatch | None = None
        self.meta: Any = None
        # one set of buffers per linear holding a targeted projection; where each HF module's
        # A and B go in them (slice index, output offset, width)
        self.where: dict[str, tuple[_Projection, int, int, int]] = {}
        self.projections: list[_Projection] = []
        R = max_rank
        for linear in dict.fromkeys(lin for name, (lin, _) in self.targets.items()
                                    if name.rsplit(".", 1)[-1] in self.allowed):
            slices = tuple(linear.output_sizes)
            w = LoRAWeights(
                a=torch.zeros(num_slots, len(slices) * R, linear.input_size, dtype=dtype,
                              device=device),
                b=torch.zeros(num_slots, linear.output_size, R, dtype=dtype, device=device),
                scalings=torch.zeros(num_slots, dtype=torch.float32, device=device),
                output_slices=slices, max_rank=R)
            proj = _Projection(self, w)
            self.projections.append(proj)
            linear.epilogue = proj
            for name, (lin, shard) in self.targets.items():
                if lin is linear:
                    j = 0 if shard is None else linear.shard_names.index(shard)
                    sl = linear.shard_slice(shard)
                    self.where[name] = (proj, j, sl.start, sl.stop - sl.start)
        reset_bindings(model)

    # -- adapters --------------------------------------------------------------------------------

    def load(self, name: str, path: str) -> HostAdapter:
        """Read `path` as adapter `name` into host memory; AdapterError (nothing changed) when
        it cannot be served or the name is taken."""
        if not isinstance(name, str) or not name.strip():
            raise AdapterError("a LoRA adapter needs a non-empty name")
        if name in self.adapters:
            raise AdapterError(f"LoRA adapter {name!r} is already loaded")
        adapter = read_adapter(name, path, self._uid + 1, self.targets, self.allowed,
                               self.max_rank, self.dtype)
        self._uid += 1
        self.adapters[name] = adapter
        return adapter

    def unload(self, name: str) -> None:
        """Forget adapter `name` (its device slot is freed once no request holds it);
        AdapterError when it is not loaded."""
        adapter = self.adapters.pop(name, None)
        if adapter is None:
            raise AdapterError(f"LoRA adapter {name!r} is not loaded")
        for s, uid in enumerate(self.slot_uid):
            if uid == adapter.uid and self.refs[s] == 0:
                self.slot_uid[s], self.ranks[s] = None, 0

    def lookup(self, name: str) -> int:
        """The uid of loaded adapter `name`; AdapterError when none is."""
        adapter = self.adapters.get(name)
        if adapter is None:
            raise AdapterError(f"LoRA adapter {name!r} is not loaded")
        return adapter.uid

    def listing(self) -> list[dict[str, object]]:
        return [{"name": a.name, "path": a.path, "rank": a.rank, "scaling": a.scaling,
                 "target_modules": sorted(a.kinds)} for a in self.adapters.values()]

    # -- slots -----------------------------------------------------------------------------------

    def acquire(self, uid: int | None) -> int | None:
        """A device slot holding adapter `uid`, pinned until `release` (BASE_SLOT for None);
        None when every slot is pinned by other adapters (the request waits)."""
        if uid is None:
            return BASE_SLOT
        self._tick += 1
        if uid in self.slot_uid:
            s = self.slot_uid.index(uid)
        else:
            adapter = next((a for a in self.adapters.values() if a.uid == uid), None)
            if adapter is None:
                raise AdapterError(f"LoRA adapter (load {uid}) was unloaded")
            free = [s for s in range(self.num_slots) if self.refs[s] == 0]
            if not free:
                return None
            s = min(free, key=lambda i: (self.slot_uid[i] is not None, self.used[i]))
            self._fill(s, adapter)
        self.refs[s] += 1
        self.used[s] = self._tick
        return s

    def release(self, slot: int) -> None:
        if slot != BASE_SLOT:
            self.refs[slot] -= 1
            assert self.refs[slot] >= 0, "LoRA slot released more often than acquired"
            uid = self.slot_uid[slot]
            if self.refs[slot] == 0 and all(a.uid != uid for a in self.adapters.values()):
                self.slot_uid[slot], self.ranks[slot] = None, 0  # unloaded meanwhile

    def _fill(self, s: int, adapter: HostAdapter) -> None:
        """Copy `adapter` into slot s of every projection's buffers (zeros where it has no
        weights)."""
        R = self.max_rank
        for proj in self.projections:
            proj.weights.a[s].zero_()
            proj.weights.b[s].zero_()
            proj.weights.scalings[s] = adapter.scaling
        for module, (a, b) in adapter.modules.items():
            proj, j, off, width = self.where[module]
            proj.weights.a[s, j * R:j * R + adapter.rank].copy_(a)
            proj.weights.b[s, off:off + width, :adapter.rank].copy_(b)
        self.slot_uid[s], self.ranks[s] = adapter.uid, adapter.rank
        self.loads += 1

    # -- steps -----------------------------------------------------------------------------------

    def begin_step(self, lens: Sequence[int], slots: Sequence[int] | None) -> None:
        """This step's segments: request i's lens[i] tokens use slots[i] (None: all base)."""
        if slots is None or all(s == BASE_SLOT for s in slots):
            self.batch, self.meta = None, None
            return
        seg_lens: list[int] = []
        seg_slots: list[int] = []
        for n, s in zip(lens, slots, strict=True):
            if seg_slots and seg_slots[-1] == s:
                seg_lens[-1] += n
            else:
                seg_lens.append(n)
                seg_slots.append(s)
        indptr = [0]
        for n in seg_lens:
            indptr.append(indptr[-1] + n)
        self.batch = LoRABatch(
            seg_lens=seg_lens, seg_slots=seg_slots, ranks=list(self.ranks),
            seg_indptr=torch.tensor(indptr, dtype=torch.int32).to(self.device),
            seg_slots_t=torch.tensor(seg_slots, dtype=torch.int32).to(self.device))
        self.meta = self.backend.prepare(self.batch)

    def begin_graph_step(self, seg_indptr: torch.Tensor, seg_slots_t: torch.Tensor) -> None:
        """A decode graph's step (inside the captured forward): one token per row, row i's slot
        seg_slots_t[i] on the device only (-1: base or padding), seg_indptr = 0..T; the backend
        prepares from those tensors alone (core.contract.lora, device-only steps)."""
        if not self.graph_safe:
            raise RuntimeError("decode graphs hold adapter deltas only with a graph-safe LoRA "
                               "backend (LoRACaps.graph_safe)")
        self.batch = LoRABatch.on_device(seg_indptr, seg_slots_t)
        self.meta = self.backend.prepare(self.batch)

    def end_step(self) -> None:
        """No step open: the projections add nothing until the next begin_step."""
        self.batch, self.meta = None, None

    def stats(self) -> dict[str, int]:
        return {"lora_adapters": len(self.adapters),
                "lora_slots_used": sum(u is not None for u in self.slot_uid),
                "lora_slot_loads": self.loads}
