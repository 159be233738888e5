"""LoRA serving's pure part: the adapters named on the command line (SGLang's --lora-paths,
vLLM's --lora-modules), the target modules asked for, and the LoRA backend slot of the plan.

No torch and no file is read here: adapters are read and checked when the worker loads them
(core.engine.lora), which names what is wrong with one.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from core.plan.args import ServerArgs, lora_enabled

# The projections of a decoder layer an adapter may target, by their HF names.
LORA_MODULE_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                     "down_proj")
DEFAULT_MAX_RANK = 16  # vLLM's default, when no adapter is given at start


@dataclass(frozen=True)
class AdapterSpec:
    """One adapter to load: the name requests use, and its folder (PEFT's files)."""

    name: str
    path: str


def _one(raw: str, flag: str) -> AdapterSpec:
    text = raw.strip()
    if text.startswith("{"):  # vLLM's JSON form
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{flag} {raw!r}: not JSON: {exc}") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) \
                or not isinstance(obj.get("path"), str):
            raise ValueError(f'{flag} {raw!r}: expected {{"name": ..., "path": ...}}')
        unknown = sorted(set(obj) - {"name", "path", "base_model_name"})
        if unknown:
            raise ValueError(f"{flag} {raw!r}: unknown key(s) {', '.join(unknown)}")
        name, path = obj["name"], obj["path"]
    elif "=" in text:
        name, _, path = text.partition("=")
    else:  # a bare path: named after its folder
        path = text
        name = os.path.basename(os.path.normpath(text))
    name, path = name.strip(), path.strip()
    if not name or not path:
        raise ValueError(f"{flag} {raw!r}: expected NAME=PATH")
    return AdapterSpec(name, path)


def adapter_specs(args: ServerArgs) -> list[AdapterSpec]:
    """The adapters to load at start, in order; ValueError for a malformed entry or a name
    given twice."""
    specs = [_one(v, "--lora-paths") for v in args.lora_paths or ()]
    specs += [_one(v, "--lora-modules") for v in args.lora_modules or ()]
    seen: set[str] = set()
    for s in specs:
        if s.name in seen:
            raise ValueError(f"LoRA adapter name {s.name!r} is given twice")
        seen.add(s.name)
    return specs


def target_modules_arg(args: ServerArgs, supported: frozenset[str]) -> frozenset[str] | None:
    """--lora-target-modules as a set (None: left open, taken from the adapters loaded at
    start); `all` is every module the model supports. ValueError naming unknown modules."""
    raw = args.lora_target_modules
    if raw is None:
        return None
    names = {n.strip() for n in raw}
    if "all" in names:
        return frozenset(supported)
    unknown = sorted(names - set(supported))
    if unknown:
        raise ValueError(f"--lora-target-modules: {', '.join(unknown)} not a projection this "
                         f"model takes adapters on ({', '.join(sorted(supported)) or 'none'})")
    return frozenset(names)


__all__ = ["LORA_MODULE_NAMES", "DEFAULT_MAX_RANK", "AdapterSpec", "adapter_specs",
           "target_modules_arg", "lora_enabled"]
