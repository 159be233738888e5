"""Comma-list flags of the bench scripts (--modes, --peers, --tp-sizes, ...), parsed one way."""

from __future__ import annotations

import argparse
from collections.abc import Sequence


def choice_list(p: argparse.ArgumentParser, flag: str, text: str, choices: Sequence[str]
                ) -> list[str]:
    """The comma list `text` of names from `choices` (order kept); p.error() names what is
    unknown, or that nothing was given."""
    got = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in got if x not in choices]
    if bad or not got:
        p.error(f"{flag}: unknown {', '.join(bad) or '(none given)'}; choose from "
                f"{', '.join(choices)}")
    return got


def int_list(p: argparse.ArgumentParser, flag: str, text: str, minimum: int = 1) -> list[int]:
    """The comma list `text` of integers >= minimum, sorted, without repeats."""
    try:
        got = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        p.error(f"{flag}: expected a comma list of integers, got {text!r}")
    if not got or got[0] < minimum:
        p.error(f"{flag}: expected integers >= {minimum}, got {text!r}")
    return got
