"""Shape checks for JSON values crossing a process boundary (core.messages's messages): small
predicates and `fields`, which checks an object's keys and each value's JSON type and raises a
ValueError naming what is wrong."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

Check = Callable[[Any], bool]


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def optional(check: Check) -> Check:
    return lambda v: v is None or check(v)


def list_of(check: Check) -> Check:
    return lambda v: isinstance(v, list) and all(check(x) for x in v)


def of_type(kind: type) -> Check:
    return lambda v: isinstance(v, kind)


def fields(d: Any, what: str, spec: dict[str, tuple[Check, str]],
           optional: tuple[str, ...] = ()) -> dict[str, Any]:
    """`d`'s fields after checking that it is an object with exactly `spec`'s keys (those in
    `optional` may be left out) and that each value has its JSON type."""
    if not isinstance(d, dict):
        raise ValueError(f"malformed {what}: expected an object, got {type(d).__name__}")
    unknown = sorted(set(d) - set(spec) - {"type"})
    if unknown:
        raise ValueError(f"malformed {what}: unknown field(s) {', '.join(unknown)}")
    missing = [k for k in spec if k not in d and k not in optional]
    if missing:
        raise ValueError(f"malformed {what}: missing field(s) {', '.join(missing)}")
    for key, (check, want) in spec.items():
        if key in d and not check(d[key]):
            raise ValueError(f"malformed {what}: {key} must be {want}, got {d[key]!r:.80}")
    return {k: d[k] for k in spec if k in d}
