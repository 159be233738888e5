"""A parser flag's value as a registered parser: `--tool-call-parser` and `--reasoning-parser`
take a name, one of its aliases, `auto` or the off word; an unknown name or a parser whose
packages are missing is an error before anything starts (the template-dependent choice comes
later: core.plan.resolver.resolve_tool_parser, core.plan.reasoning.resolve_reasoning_parser)."""

from __future__ import annotations

from core.plan.checks import missing_packages
from core.plan.plan import ResolveError
from core.plan.registry import Registry


def parser_named(registry: Registry, kind: str, name: str) -> str | None:
    """The registered parser of `kind` that `name` stands for (its name or one of its
    aliases)."""
    regs = registry.kind(kind)
    if name in regs:
        return name
    return next((n for n, r in sorted(regs.items()) if name in r.caps.aliases), None)


def parser_arg(registry: Registry, kind: str, raw: str, off: str, flag: str,
               what: str) -> str | None:
    """`raw` (the flag's value, stripped) as a registered name; None for auto and `off`."""
    if raw in ("auto", off):
        return None
    name = parser_named(registry, kind, raw)
    if name is None:
        regs = registry.kind(kind)
        known = [f"{n} (also {', '.join(sorted(r.caps.aliases))})" if r.caps.aliases else n
                 for n, r in sorted(regs.items())]
        raise ResolveError(f"unknown {what} {raw!r} ({flag})",
                           [f"registered {what}s: {', '.join(known) or 'none'}; or auto, "
                            f"{off}"])
    missing = missing_packages(registry.get(kind, name).caps.requires)
    if missing:  # the one reason a named parser may not fit: known before anything starts
        raise ResolveError(f"{what} {name!r} ({flag}) does not fit",
                           [f"package {m} is not installed" for m in missing])
    return name
