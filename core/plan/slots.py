"""One slot being resolved: every registered candidate checked, the fitting ones ranked, the
user's pick honoured or refused with reasons; and several slots' errors merged into one.

The resolver (core.plan.resolver) builds one Slot per slot it fills; the labels name slots and kinds
in messages and in the plan's explanation.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from core.plan.plan import Candidate, ResolveError
from core.plan.registry import Registry

SLOT_LABELS = {
    "quant_method": "quant method",
    "prefill_attention": "prefill attention backend",
    "decode_attention": "decode attention backend",
    "moe_runner": "MoE runner",
    "layer_ops": "layer ops",
    "model": "model implementation",
    "grammar_backend": "grammar backend",
    "tool_call_parser": "tool-call parser",
    "spec_proposer": "speculative proposer",
    "reasoning_parser": "reasoning parser",
    "lora_backend": "LoRA backend",
}
KIND_LABELS = {"attention": "attention backends", "moe": "MoE runners",
               "quant": "quant methods", "models": "model implementations",
               "layer_ops": "layer-ops plugins",
               "grammar": "grammar backends", "tool_parser": "tool-call parsers",
               "spec": "speculative proposers", "reasoning_parser": "reasoning parsers",
               "lora": "LoRA backends"}


class Slot:
    """One slot being resolved: its evaluated candidates and the user's pick, if any."""

    def __init__(self, slot: str, kind: str, registry: Registry, target: str,
                 check: Callable[[Any, str], list[str]], user: str | None, flag: str):
        """check(caps, name) -> reasons the named plugin does not fit (empty: it fits); caps
        are the kind's (CAPS_TYPES[kind]), so `check` takes that one type."""
        self.slot, self.kind, self.user, self.flag = slot, kind, user, flag
        self.label = SLOT_LABELS[slot]
        regs = registry.kind(kind)
        self.names = sorted(regs)
        self.candidates = [
            Candidate(slot=slot, name=name, origin=regs[name].origin.describe(),
                      fits=not (reasons := tuple(check(regs[name].caps, name))), reasons=reasons,
                      priority=priority(regs[name].caps, target))
            for name in self.names]

    def get(self, name: str) -> Candidate:
        return next(c for c in self.candidates if c.name == name)

    def ranked(self) -> list[Candidate]:
        """Fitting candidates, best first: the user's choice, then priority, then name."""
        fits = [c for c in self.candidates if c.fits]
        return sorted(fits, key=lambda c: (c.name != self.user, -c.priority, c.name))

    def would_fit(self) -> list[str]:
        return [c.name for c in self.ranked()]

    def options(self) -> list[Candidate]:
        """What this slot may use: the user's pick alone, or every fitting candidate.

        Raises ResolveError when the pick is unknown or does not fit, or when nothing fits.
        """
        if self.user is not None:
            if self.user not in self.names:
                raise ResolveError(
                    f"unknown {self.label} {self.user!r} ({self.flag})",
                    [f"registered {KIND_LABELS[self.kind]}: {', '.join(self.names) or 'none'}"],
                    self.would_fit())
            chosen = self.get(self.user)
            if not chosen.fits:
                raise ResolveError(f"{self.label} {self.user!r} ({self.flag}) does not fit",
                                   list(chosen.reasons), self.would_fit())
            return [chosen]
        ranked = self.ranked()
        if not ranked:
            raise ResolveError(self.nothing_fits(), self.all_reasons())
        return ranked

    def nothing_fits(self) -> str:
        return f"no {self.label} fits"

    def all_reasons(self, first: Sequence[str] = ()) -> list[str]:
        """Every candidate's reasons, those most likely meant first: the candidates named in
        `first`, then by priority on the target (the backends that would rank first), then
        name."""
        if not self.candidates:
            return [f"no {self.label} is registered"]
        order = sorted(self.candidates, key=lambda c: (c.name not in first, -c.priority, c.name))
        return [f"{c.name}: {r}" for c in order for r in c.reasons]


def priority(caps: object, target: str) -> int:
    """The plugin's declared priority for a device target (0 when it declares none)."""
    return int(getattr(caps, "priority", {}).get(target, 0))


def merge_errors(errors: list[ResolveError], candidates: tuple[Candidate, ...] = ()
           ) -> ResolveError:
    """One error from several; a decode error that repeats the prefill one is said once."""
    unique: list[ResolveError] = []
    for e in errors:
        twin = next((u for u in unique if u.args[0].replace("prefill", "decode") == e.args[0]),
                    None)
        if twin is None:
            unique.append(e)
        else:  # the same failure in both phases: name no phase, keep every distinct reason
            twin.args = (twin.args[0].replace("prefill ", "", 1),)
            twin.reasons += [r for r in e.reasons if r not in twin.reasons]
            twin.would_fit = [w for w in twin.would_fit if w in e.would_fit]
    if len(unique) == 1:
        e = unique[0]
        return ResolveError(e.args[0], e.reasons, e.would_fit, candidates or e.candidates)
    merged = ResolveError("; ".join(e.args[0] for e in unique),
                          [r for e in unique for r in e.reasons],
                          [w for e in unique for w in e.would_fit], candidates)
    merged.errors = unique  # type: ignore[attr-defined]
    return merged
