"""Compile a plan's kernels before the engine asks for them (start-up; issue 37).

A backend whose caps need a C compiler (`programs=("cc",)`: the GGUF kernels, cpu_c attention
and layer ops) builds its library on first use, in the engine process, after the weights are
read: on a new machine ~4 s of `cc` on the start's critical path. Its factory may offer a hook:

    prebuild() -> None    (a classmethod or staticmethod; no arguments)

which compiles what the entry will load into the on-disk kernel cache: no model, no device
memory, nothing loaded into the process, safe on a thread. As soon as the plan is resolved
(core.frontend.offline.Engine), each chosen entry with that need and that hook gets a daemon
thread calling it, so the compiles (separate `cc` processes) run while the server loads the
tokenizer and the engine process reads the model. The engine's own build then finds the file,
or waits on the build's lock (plugins._kit.cbuild.compiled) rather than compiling it again.
A failure here is dropped: the engine's build raises it with the compiler's message.
"""

from __future__ import annotations

import logging
import threading

from core.plan.plan import Plan
from core.plan.registry import Registration, Registry

log = logging.getLogger(__name__)

# plan field -> the registration kind that fills it
SLOT_KINDS = (("quant_method", "quant"), ("prefill_attention", "attention"),
              ("decode_attention", "attention"), ("layer_ops", "layer_ops"),
              ("moe_runner", "moe"))


def prebuild_entries(plan: Plan, registry: Registry) -> list[Registration]:
    """The plan's chosen entries (a draft model's plan's too) whose caps need a C compiler,
    each once, in slot order."""
    out: list[Registration] = []
    todo: Plan | None = plan
    while todo is not None:
        for field_name, kind in SLOT_KINDS:
            name = getattr(todo, field_name)
            reg = registry.get(kind, name) if name else None
            if reg is not None and "cc" in (getattr(reg.caps, "programs", ()) or ()) \
                    and all(r is not reg for r in out):
                out.append(reg)
        todo = todo.spec_draft
    return out


def _run(reg: Registration) -> None:
    try:
        hook = getattr(reg.load(), "prebuild", None)
        if callable(hook):
            hook()
    except Exception as exc:  # noqa: BLE001 - the engine's own build reports it
        log.debug("prebuild of %s %s failed: %s", reg.kind, reg.name, exc)


def start_prebuilds(plan: Plan, registry: Registry) -> list[threading.Thread]:
    """One daemon thread per entry of prebuild_entries, started; the threads (tests join)."""
    threads = [threading.Thread(target=_run, args=(reg,), daemon=True,
                                name=f"prebuild-{reg.kind}-{reg.name}")
               for reg in prebuild_entries(plan, registry)]
    for t in threads:
        t.start()
    return threads
