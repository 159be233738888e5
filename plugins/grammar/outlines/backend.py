"""The outlines backend (core.contract.grammar.GrammarBackend); imported only when it is chosen.

Every constraint becomes one regex R, compiled by outlines-core as R followed by an end marker
(NUL, spelled by one marker token) instead of R alone. outlines-core 0.2.14 builds its Index from
a leftmost-first DFA whose matches show one byte late; on R alone that drops every token ending
one byte past a complete match (after "ab" under (ab)+, the token "a"), and an alternative that
extends an earlier one ("abd" in ab|abd) after the earlier one matched. With the marker, R's
matches all end at the marker, so no token of R's text is dropped; the text is complete where the
marker leads to a final state, and there the core's stop tokens are allowed (outlines-core knows
one end-of-sequence token, and errs on advancing it). Ordinary tokens containing NUL are left out
of the vocabulary (no grammar emits NUL), so only the marker spells it.
"""

from __future__ import annotations

import json
import re
from collections import OrderedDict
from typing import Any

import outlines_core as oc
from outlines_core.json_schema import build_regex_from_schema

from core.contract.grammar import Constraint, GrammarError
from plugins.grammar.outlines.schema import INVALID, prepared, problems, ref_depth

_WHAT = {"json_schema": "invalid JSON schema", "json_object": "invalid JSON object grammar",
         "regex": "invalid regex", "choice": "invalid choices"}
COMPACT = ""  # whitespace between JSON tokens: none (small models loop on free whitespace)
MARK = b"\x00"  # the end marker's text
_META = set("\\.+*?()|[]{}^$#&-~")  # what a Rust regex literal escapes
_VALIDATED = 256  # validate() answers kept (the client asks per request)


class _Unenforced(ValueError):
    """A schema whose translation would drop or mistranslate a keyword (schema.problems)."""


def _message(c: Constraint, exc: Exception) -> str:
    if isinstance(exc, _Unenforced):
        return (f"{c.where}: the JSON schema uses {exc}, which grammar backend outlines cannot "
                f"enforce")
    why = _clean(exc)
    if c.kind == "regex" and "building NFA" in why:  # outlines-core says no more than that
        try:
            re.compile(c.value)
            why += (" (not a regex a DFA can run: look-around and backreferences are not "
                    "supported)")
        except re.error as err:
            why += f" ({err})"
    return f"{c.where}: {_WHAT[c.kind]}: {why}"


def _clean(exc: Exception) -> str:
    """outlines-core's message in one line, without its "please open an issue" advice."""
    lines = [s.strip() for s in str(exc).strip().splitlines() if s.strip()]
    keep = [s for s in lines if not s.startswith(("Make sure it is valid", "If it should be"))]
    return (" ".join(keep) or type(exc).__name__)[:300]


def _literal(text: str) -> str:
    return "".join("\\" + ch if ch in _META else ch for ch in text)


def _anchors(rx: str) -> list[str]:
    """The anchors and word boundaries outside character classes (a whole text is matched, and
    the end marker follows it: an anchor inside R could never hold)."""
    found, i, depth = [], 0, 0
    while i < len(rx):
        ch = rx[i]
        if ch == "\\":
            if not depth and rx[i + 1:i + 2] in ("A", "z", "Z", "b", "B", "<", ">"):
                found.append(rx[i:i + 2])
            i += 2
            continue
        if ch == "[":
            if not depth:  # "]" first in a class (or after "^") is a literal
                i += 1 + (rx[i + 1:i + 2] == "^")
                i += rx[i:i + 1] == "]"
                depth = 1
                continue
            depth += 1  # a nested class
        elif ch == "]" and depth:
            depth -= 1
        elif ch in "^$" and not depth:
            found.append(ch)
        i += 1
    return found


def _unanchored(rx: str) -> str:
    """A regex without the leading ^ and trailing $ that a whole match makes redundant."""
    if rx.startswith("^"):
        rx = rx[1:]
    if rx.endswith("$") and (len(rx) - 1 - len(rx[:-1].rstrip("\\"))) % 2 == 0:
        rx = rx[:-1]  # not an escaped "\$"
    return rx


def _regex(c: Constraint) -> str:
    """The regular expression outlines-core compiles for `c`, end marker included (ValueError
    for what outlines-core cannot translate or this backend cannot run)."""
    if c.kind == "json_schema":
        schema = json.loads(c.value)
        bad = problems(schema)
        invalid = [b[len(INVALID):] for b in bad if b.startswith(INVALID)]
        if invalid:
            raise ValueError("; ".join(invalid))
        if bad:
            raise _Unenforced("; ".join(bad))
        # nested $refs are followed to their depth (recursive ones were refused just now)
        rx = build_regex_from_schema(json.dumps(prepared(schema)), COMPACT,
                                     max(3, ref_depth(schema)))
    elif c.kind == "json_object":
        rx = build_regex_from_schema('{"type": "object"}', COMPACT)
    elif c.kind == "regex":
        rx = _unanchored(c.value)
    elif c.kind == "choice":
        if any("\0" in x for x in c.choices()):
            raise ValueError("a choice contains NUL, which this backend never emits")
        rx = "|".join(f"(?:{_literal(x)})" for x in c.choices())
    else:
        raise ValueError(f"outlines does not compile {c.kind} constraints")
    inner = _anchors(rx)
    if inner:
        raise ValueError(f"anchors and word boundaries ({', '.join(sorted(set(inner)))}) are "
                         f"not supported here; the whole text is matched")
    return f"(?:{rx})\\x00"


class Compiled:
    """An outlines-core Index over the vocabulary with its end marker, and which states are
    complete (the marker leads to a final state), found as asked."""

    def __init__(self, index: Any, mark: int):
        self.index, self.mark = index, mark
        self._complete: dict[int, bool] = {}

    def complete(self, state: int) -> bool:
        got = self._complete.get(state)
        if got is None:
            nxt = self.index.get_next_state(state, self.mark)
            got = self._complete[state] = nxt is not None and self.index.is_final_state(nxt)
        return got


class OutlinesMatcher:
    """One sequence's outlines-core Guide under core.contract.grammar.GrammarMatcher; the end marker is
    never advanced: a stop token is accepted where the text is complete."""

    def __init__(self, compiled: Compiled, stops: frozenset[int],
                 bits: tuple[tuple[int, int, bool], ...]):
        self.c, self.stops = compiled, stops
        self.bits = bits  # (word, int32 bit, is a stop token) for the stops and the marker
        self.g = oc.Guide(compiled.index, max_rollback=0)
        self.done = False  # a stop token was accepted

    def fill_bitmask(self, bitmask: Any, row: int) -> None:
        v = bitmask[row]  # [ceil(V / 32)] int32, CPU, contiguous: written in place, every word
        assert v.is_contiguous() and v.dtype.itemsize == 4 and v.device.type == "cpu"
        if self.done:
            v.zero_()
            return
        self.g.write_mask_into(v.data_ptr(), v.numel(), 4)
        complete = self.c.complete(self.g.get_state())
        for word, bit, stop in self.bits:  # the marker's bit is a stop's, or cleared
            if stop and complete:
                v[word] |= bit
            else:
                v[word] &= ~bit

    def accept(self, token: int) -> bool:
        token = int(token)
        if self.done:
            return False
        if token in self.stops or token == self.c.mark:
            self.done = token in self.stops and self.c.complete(self.g.get_state())
            return self.done
        try:
            self.g.advance(token, return_tokens=False)
        except (ValueError, OverflowError):  # no transition: the state stays where it was
            return False
        return True

    def is_terminated(self) -> bool:
        return self.done

    def reset(self) -> None:
        self.g.reset()
        self.done = False

    def close(self) -> None:
        self.g = None


class OutlinesBackend:
    """Constraints -> a Compiled (outlines-core Index) shared by every sequence; each
    sequence's matcher is a Guide on it."""

    name = "outlines"

    def __init__(self, *, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]):
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self.stop = [t for t in dict.fromkeys(stop_token_ids) if 0 <= t < vocab_size]
        self._vocab: Any = None  # built on the first compile: validate needs no vocabulary
        self._mark = self._eos = -1
        self._validated: OrderedDict[tuple[str, str], str] = OrderedDict()

    def _vocabulary(self) -> Any:
        """outlines-core's Vocabulary: every ordinary token's bytes (Tokenizer.token_bytes)
        but those with NUL, and the end marker under the first stop token's id. Special tokens
        are left out (no grammar emits them); outlines-core's own end-of-sequence id is one
        that no token uses."""
        if self._vocab is None:
            tok = self.tokenizer
            hf = tok.hf
            added = getattr(hf, "added_tokens_decoder", None) or {}
            special = {int(i) for i, a in added.items() if getattr(a, "special", False)}
            special |= {int(i) for i in getattr(hf, "all_special_ids", None) or ()}
            special |= set(self.stop)
            n = min(len(hf), self.vocab_size)
            tokens: dict[bytes, list[int]] = {}
            for i in range(n):
                if i not in special:
                    b = tok.token_bytes(i)
                    if b and MARK not in b:
                        tokens.setdefault(b, []).append(i)
            unused = [i for i in range(self.vocab_size + 2)
                      if i >= n or (i in special and i not in self.stop[:1])]
            self._mark = self.stop[0] if self.stop else unused.pop(0)
            self._eos = unused[0]
            tokens[MARK] = [self._mark]
            self._vocab = oc.Vocabulary(self._eos, tokens)
        return self._vocab

    def validate(self, constraint: Constraint) -> None:
        key = constraint.key()
        err = self._validated.get(key)
        if err is None:
            err = self._check(constraint)
            self._validated[key] = err
            if len(self._validated) > _VALIDATED:
                self._validated.popitem(last=False)
        else:
            self._validated.move_to_end(key)
        if err:
            raise GrammarError(err)

    @staticmethod
    def _check(c: Constraint) -> str:
        """Why `c` cannot be compiled (the message; "" when it can), without the vocabulary:
        the schema's checks and translation, and a regex's DFA over single bytes (a JSON
        translation is outlines-core's own regex, left to compile: any object's DFA takes
        seconds)."""
        try:
            rx = _regex(c)
            if c.kind in ("regex", "choice"):
                oc.Index(rx, _byte_vocabulary())
        except (ValueError, TypeError, RuntimeError) as exc:
            return _message(c, exc)
        return ""

    def compile(self, constraint: Constraint) -> Compiled:
        try:
            rx = _regex(constraint)
            vocab = self._vocabulary()
            return Compiled(oc.Index(rx, vocab), self._mark)
        except (ValueError, TypeError, RuntimeError) as exc:
            raise GrammarError(_message(constraint, exc)) from None

    def serialize(self, compiled: Compiled) -> bytes:
        # outlines-core's own binary form of its Index (what its pickling uses), after the
        # marker's id
        _, (index,) = compiled.index.__reduce__()
        return compiled.mark.to_bytes(8, "little", signed=True) + bytes(index)

    def deserialize(self, data: bytes) -> Compiled:
        mark = int.from_bytes(data[:8], "little", signed=True)
        return Compiled(oc.Index.from_binary(data[8:]), mark)

    def matcher(self, compiled: Compiled) -> OutlinesMatcher:
        marked = [(t, True) for t in self.stop]
        if compiled.mark not in self.stop and compiled.mark < self.vocab_size:
            marked.append((compiled.mark, False))
        bits = tuple((t // 32, _int32_bit(t % 32), stop) for t, stop in marked)
        return OutlinesMatcher(compiled, frozenset(self.stop), bits)


def _int32_bit(j: int) -> int:
    return (1 << j) - (1 << 32 if j == 31 else 0)


_BYTES: list[Any] = []


def _byte_vocabulary() -> Any:
    """Every single byte but NUL as a token, and the marker: a regex whose DFA builds over it
    builds over any vocabulary that can spell its text."""
    if not _BYTES:
        tokens = {bytes([b]): [b] for b in range(1, 256)}
        tokens[MARK] = [256]
        _BYTES.append(oc.Vocabulary(257, tokens))
    return _BYTES[0]
