"""The reasoning parser's choice (core.contract.reasoning): `--reasoning-parser NAME|auto|none`,
made from the chat template's text once the tokenizer is loaded, like the tool-call parser's
(core.plan.resolver.resolve_tool_parser)."""

from __future__ import annotations

import dataclasses

from core.contract.reasoning import REASONING_PARSER_OFF
from core.plan.args import ServerArgs
from core.plan.checks import missing_packages
from core.plan.parser_names import parser_arg
from core.plan.plan import Candidate, Plan, ResolveError
from core.plan.registry import Registry

SLOT = "reasoning_parser"


def reasoning_parser_arg(args: ServerArgs, registry: Registry) -> str | None:
    """--reasoning-parser as a registered name (None for auto / none); an unknown name is an
    error before anything starts, listing the known ones."""
    return parser_arg(registry, SLOT, (args.reasoning_parser or REASONING_PARSER_OFF).strip(),
                      REASONING_PARSER_OFF, "--reasoning-parser", "reasoning parser")


def resolve_reasoning_parser(plan: Plan, chat_template: str | None, args: ServerArgs,
                             registry: Registry) -> Plan:
    """The plan with its reasoning parser, chosen from the chat template's text.

    none (the default): off, the output is all content as the model wrote it. auto: the
    parsers whose markers (ReasoningParserCaps.markers) the template holds all fit; the one
    holding the most of them, then the best priority, is chosen (Qwen3's template holds
    `<think>` and `enable_thinking`: qwen3 over deepseek-r1); none fits: off, and the notes
    say why. A named parser is honoured (a note says when the template shows none of its
    markers). Every candidate goes into the table with its reasons."""
    raw = (args.reasoning_parser or REASONING_PARSER_OFF).strip()
    regs = registry.kind("reasoning_parser")
    template = chat_template or ""
    if raw == REASONING_PARSER_OFF:
        return plan  # off by default: nothing to explain beyond the flag's help
    user = reasoning_parser_arg(args, registry)
    found = {n: [m for m in r.caps.markers if m in template] for n, r in regs.items()}
    reasons: dict[str, list[str]] = {}
    for name, reg in regs.items():
        why = [f"package {m} is not installed" for m in missing_packages(reg.caps.requires)]
        lacks = [m for m in reg.caps.markers if m not in template]
        if user is None and (lacks or not reg.caps.markers):
            why.append(f"the chat template lacks its marker(s) {', '.join(lacks)}" if lacks
                       else "it declares no markers to find in a chat template")
        reasons[name] = why
    fits = sorted((n for n in regs if not reasons[n]),
                  key=lambda n: (n != user, -len(found[n]), -regs[n].caps.priority, n))
    notes: list[str] = []
    chosen = fits[0] if fits else None
    if user is not None:
        if reasons[user]:
            raise ResolveError(f"reasoning parser {user!r} (--reasoning-parser) does not fit",
                               reasons[user], fits)
        chosen = user
        if not found[user]:
            notes.append(f"reasoning parser {user} (--reasoning-parser): the chat template "
                         f"shows none of its markers ({', '.join(regs[user].caps.markers)}); "
                         "the model may not write its format")
        else:
            notes.append(f"reasoning parser {user} (--reasoning-parser)")
    elif chosen is None:
        notes.append("reasoning parser off: no reasoning parser's markers are all in the chat "
                     "template (" + "; ".join(f"{n}: {r}" for n, rs in sorted(reasons.items())
                                              for r in rs) + ") (--reasoning-parser auto)")
    else:
        second = fits[1] if len(fits) > 1 else None
        why = ""
        if second is not None and len(found[second]) < len(found[chosen]):
            why = f"; more of them than {second}'s ({', '.join(found[second])})"
        elif second is not None:
            why = f"; the best priority of {', '.join(fits)}"
        notes.append(f"reasoning parser {chosen}: the chat template holds its markers "
                     f"({', '.join(found[chosen])}){why} (--reasoning-parser auto)")
    if chosen is not None:
        caps = regs[chosen].caps
        if caps.thinking_kwarg:
            notes.append(f"thinking is switched per request by chat_template_kwargs "
                         f"{{\"{caps.thinking_kwarg}\": false}} (the output is then all "
                         "content)")
    cands = tuple(Candidate(slot=SLOT, name=n, origin=regs[n].origin.describe(),
                            fits=not reasons[n], reasons=tuple(reasons[n]),
                            priority=regs[n].caps.priority, chosen=n == chosen)
                  for n in sorted(regs))
    return dataclasses.replace(plan, reasoning_parser=chosen, notes=plan.notes + tuple(notes),
                               candidates=plan.candidates + cands)
