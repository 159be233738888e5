"""The resolver's output: a plan per slot, and the table of every candidate with its reasons."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields

from core.contract.capabilities import DeviceInfo


@dataclass(frozen=True)
class Candidate:
    """One registered backend considered for one slot."""

    slot: str  # prefill_attention | decode_attention | moe_runner | quant_method | layer_ops |
    # model | grammar_backend | tool_call_parser | spec_proposer | reasoning_parser |
    # lora_backend
    name: str
    origin: str  # distribution and version that registered it
    fits: bool
    reasons: tuple[str, ...] = ()  # why it does not fit (empty when it fits)
    priority: int = 0
    chosen: bool = False


@dataclass(frozen=True)
class Plan:
    """What the engine will use. Every value the user left open and the plan chose is in `notes`."""

    device: DeviceInfo
    dtype: str  # compute dtype name
    prefill_attention: str
    decode_attention: str
    moe_runner: str | None  # None for dense models
    quant_method: str
    kv_cache_dtype: str  # storage dtype name (never "auto")
    page_size: int
    cuda_graph: bool
    model_impl: str | None  # registered models plugin serving the architecture, if any
    notes: tuple[str, ...] = ()
    candidates: tuple[Candidate, ...] = ()
    layer_ops: str = "torch"  # the layer-ops plugin (core.contract.layer_ops)
    # the weights' format (core.plan.quant_scheme.FORMATS); differs from the checkpoint's when quantized
    # at load (a dense checkpoint with --quantization fp8 -> fp8_channel)
    quant_format: str = "dense"
    # the grammar backend for structured output (core.contract.grammar); None: structured output is off
    # (--grammar-backend none, or nothing fits under auto: the notes say why)
    grammar_backend: str | None = None
    # the tool-call parser for tool calling in chat (core.contract.tools); None: auto tool calls off
    # (--tool-call-parser none). Chosen from the chat template once the tokenizer is loaded
    # (core.plan.resolver.resolve_tool_parser), so a plan made without one leaves it None.
    tool_call_parser: str | None = None
    # the speculative-decoding proposer (core.contract.spec) and its drafts per step; None:
    # speculation off (no --speculative-algorithm)
    spec_proposer: str | None = None
    spec_draft_tokens: int = 0
    # a draft-model proposer's draft (--speculative-draft-model-path): its own plan (dtype,
    # quant method, attention backends, model impl), resolved like the target's; None otherwise
    spec_draft: Plan | None = None
    # verify steps replay the decode graphs as decode rows (decode graphs on, and the decode
    # attention declares AttentionCaps.verify_rows); False: they run eagerly as extends
    spec_verify_graphs: bool = False
    # the speculation governor (core.engine.scheduler.governor): --speculative-governor, or
    # where that is left open, on for a CPU device and off elsewhere (the resolver's note)
    spec_governor: bool = False
    # the reasoning parser (core.contract.reasoning); None: off (--reasoning-parser none, or
    # auto found none of its markers in the template). Chosen with the tool-call parser
    # (core.plan.reasoning.resolve_reasoning_parser).
    reasoning_parser: str | None = None
    # LoRA serving (core.contract.lora): the backend (None: LoRA off), the adapter slots on the
    # device, the largest rank (None: the largest of the adapters loaded at start) and the
    # projections adapters may target (empty: those of the adapters loaded at start)
    lora_backend: str | None = None
    lora_slots: int = 0
    lora_max_rank: int | None = None
    lora_target_modules: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, object]:
        # Not asdict(self): it deep-copies DeviceInfo.extra, a mappingproxy, which cannot be.
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["device"] = {f.name: getattr(self.device, f.name) for f in fields(self.device)}
        d["device"]["features"] = sorted(self.device.features)
        d["device"]["extra"] = dict(self.device.extra)
        d["notes"] = list(self.notes)
        d["candidates"] = [asdict(c) for c in self.candidates]
        d["spec_draft"] = self.spec_draft.to_dict() if self.spec_draft is not None else None
        return d

    @classmethod
    def from_dict(cls, d: object) -> Plan:
        """The plan `to_dict` gave (how the worker receives it: resolved once, in the parent);
        ValueError when `d` is not that shape."""
        if not isinstance(d, dict) or not isinstance(d.get("device"), dict):
            raise ValueError("malformed plan: expected an object with a device object")
        _check_keys(d, cls, "plan")
        _check_keys(d["device"], DeviceInfo, "plan device")
        try:
            device = DeviceInfo(**{**d["device"], "features": frozenset(d["device"]["features"]),
                                   "extra": dict(d["device"]["extra"])})
            candidates = tuple(Candidate(**{**c, "reasons": tuple(c["reasons"])})
                               for c in d["candidates"])
            draft = d.get("spec_draft")
            return cls(**{**d, "device": device, "notes": tuple(d["notes"]),
                          "candidates": candidates,
                          "spec_draft": cls.from_dict(draft) if draft is not None else None,
                          "lora_target_modules": tuple(d.get("lora_target_modules", ()))})
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"malformed plan: {type(exc).__name__}: {exc}") from None


def _check_keys(d: Mapping[str, object], cls: type, what: str) -> None:
    names = {f.name for f in fields(cls)}
    unknown = sorted(set(d) - names)
    if unknown:
        raise ValueError(f"malformed {what}: unknown field(s) {', '.join(unknown)}")


class ResolveError(Exception):
    """Nothing fits, or a user setting conflicts: carries every reason and what would fit."""

    def __init__(self, message: str, reasons: list[str] | None = None,
                 would_fit: list[str] | None = None, candidates: tuple[Candidate, ...] = ()):
        super().__init__(message)
        self.reasons = list(reasons or [])
        self.would_fit = list(would_fit or [])
        self.candidates = candidates

    def __str__(self) -> str:
        lines = [self.args[0]]
        lines += [f"  - {r}" for r in self.reasons]
        if self.would_fit:
            lines.append(f"  backends that would fit: {', '.join(self.would_fit)}")
        return "\n".join(lines)
