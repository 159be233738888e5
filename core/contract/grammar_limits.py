"""Bounds on a structured-output constraint, checked at the edge before any grammar library sees
it (pure Python, no recursion, linear in the constraint's size).

Grammar libraries recurse over a constraint's nesting in C++ or Rust: a regex of ~3,000 nested
groups, an EBNF rule of ~5,000 nested parentheses, or a chain of ~10,000 `$ref`s overflows
xgrammar's stack and kills the process that called it (SIGSEGV, nothing logged), and a JSON
schema's compile time grows about as its depth cubed (2.7 s at 400 nested arrays). Compiles run
in a child process with a deadline (core.engine.grammar_compiler), so a crash or a hang costs only that
child; these limits make the known cases a 400 that names the limit instead of a wasted compile.

The limits are far above what real schemas use (OpenAI's structured outputs allow 5 levels of
nesting and 100 properties; tool schemas rarely pass 10 levels):

    value_chars      256 KiB    the constraint's text (schema JSON, regex, grammar, choices)
    schema_depth     64         subschemas nested, $refs to local definitions followed (a
                                recursive reference counts once)
    schema_nodes     20,000     subschemas in all
    regex_depth      128        groups nested in any regex (a `regex` constraint, a schema's
                                `pattern` / `patternProperties`), parentheses nested in EBNF
    choices          10,000     `choice` alternatives
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from core.contract.json_types import JSON


@dataclass(frozen=True)
class GrammarLimits:
    value_chars: int = 256 * 1024
    schema_depth: int = 64
    schema_nodes: int = 20_000
    regex_depth: int = 128
    choices: int = 10_000


LIMITS = GrammarLimits()


class LimitError(ValueError):
    """A constraint past one of the limits (core.contract.grammar.GrammarError is raised from it)."""


def check_limits(kind: str, value: str, where: str, limits: GrammarLimits = LIMITS,
                 parse: Callable[[], JSON] | None = None) -> None:
    """Raise LimitError naming the limit a constraint (its kind and text) passes. Runs before
    the constraint's shape is checked: its JSON is parsed only once its size is known, by
    `parse()` when given (the caller's parse, kept for its own checks), else here."""
    if parse is None:
        parse = lambda: json.loads(value)  # noqa: E731
    if len(value) > limits.value_chars:
        raise LimitError(f"{where}: the constraint is {len(value)} characters; the limit "
                         f"is {limits.value_chars}")
    if kind in ("regex", "ebnf"):
        depth = nesting(value, kind)
        if depth > limits.regex_depth:
            raise LimitError(f"{where}: the {kind} nests {depth} levels of parentheses; "
                             f"the limit is {limits.regex_depth}")
    elif kind == "choice":
        choices = parse_json(parse, where)
        if isinstance(choices, list) and len(choices) > limits.choices:
            raise LimitError(f"{where}: {len(choices)} choices; the limit is {limits.choices}")
    elif kind == "json_schema":
        check_schema(parse_json(parse, where), where, limits)
    elif kind == "structural_tag":
        tag = parse_json(parse, where)
        structures = tag.get("structures") if isinstance(tag, dict) else None
        for i, s in enumerate(structures if isinstance(structures, list) else []):
            if isinstance(s, dict):
                check_schema(s.get("schema"), f"{where} structure {i}", limits)


def parse_json(parse: Callable[[], JSON], where: str) -> JSON:
    """A constraint's JSON value, from `parse()` (None when it is not JSON: the shape check says
    why); LimitError, not a RecursionError, when it nests deeper than Python's parser goes."""
    try:
        return parse()
    except LimitError:
        raise
    except RecursionError:
        raise LimitError(f"{where}: the JSON nests too deeply to parse") from None
    except ValueError:
        return None


def nesting(text: str, kind: str) -> int:
    """The deepest nesting of parentheses in a regex (escapes and character classes skipped) or
    an EBNF grammar (quoted strings, character classes and comments skipped)."""
    depth = deepest = i = 0
    n = len(text)
    while i < n:
        ch = text[i]
        if ch == "\\":
            i += 2
            continue
        if ch == "[":  # a class: "]" first (after "^") is a literal
            i += 1
            i += i < n and text[i] == "^"
            i += i < n and text[i] == "]"
            while i < n and text[i] != "]":
                i += 2 if text[i] == "\\" else 1
        elif kind == "ebnf" and ch in "\"'":
            i += 1
            while i < n and text[i] != ch:
                i += 2 if text[i] == "\\" else 1
        elif kind == "ebnf" and ch == "#":
            while i < n and text[i] != "\n":
                i += 1
        elif ch == "(":
            depth += 1
            deepest = max(deepest, depth)
        elif ch == ")":
            depth = max(depth - 1, 0)
        i += 1
    return deepest


# JSON-schema keywords whose values are subschemas
_SUB_ONE = ("items", "not", "additionalProperties", "contains", "if", "then", "else",
            "propertyNames", "additionalItems", "unevaluatedItems", "unevaluatedProperties")
_SUB_LIST = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
_SUB_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def subschemas(s: JSON) -> list[JSON]:
    """The direct subschemas of a JSON schema (values of its subschema keywords)."""
    if not isinstance(s, dict):
        return []
    out = [s.get(k) for k in _SUB_ONE if k in s]
    for k in _SUB_LIST:
        out += s.get(k) if isinstance(s.get(k), list) else []
    for k in _SUB_MAP:
        out += list(s.get(k).values()) if isinstance(s.get(k), dict) else []
    return out


def _local_ref(root: JSON, ref: JSON) -> JSON:
    """The subschema a local `$ref` ("#", "#/$defs/x", "#/definitions/x/...") names, or None."""
    if not isinstance(ref, str) or not ref.startswith("#"):
        return None
    node = root
    for part in ref[1:].split("/")[1:] if ref != "#" else []:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def _check_patterns(node: JSON, where: str, limits: GrammarLimits) -> None:
    """The regexes a schema node holds (`pattern`, `patternProperties`' names) nest within
    the regex limit."""
    if not isinstance(node, dict):
        return
    found = [node["pattern"]] if isinstance(node.get("pattern"), str) else []
    if isinstance(node.get("patternProperties"), dict):
        found += list(node["patternProperties"])
    for rx in found:
        depth = nesting(rx, "regex")
        if depth > limits.regex_depth:
            raise LimitError(f"{where}: a pattern in the JSON schema nests {depth} levels of "
                             f"groups; the limit is {limits.regex_depth}")


def check_schema(schema: JSON, where: str, limits: GrammarLimits = LIMITS) -> None:
    """Depth (local $refs followed, a $ref adding no level of its own, a reference back into
    its own chain counted once) and node count of a JSON schema, walked without recursion; LimitError naming the limit passed."""
    depth_of: dict[int, int] = {}  # id(subschema) -> its depth, once known
    on_path: set[int] = set()
    nodes = 0
    # (schema, children or None before they are listed, index of the next child)
    stack: list[list[Any]] = [[schema, None, 0]]
    while stack:
        top = stack[-1]
        node, kids = top[0], top[1]
        if kids is None:
            nodes += 1
            if nodes > limits.schema_nodes:
                raise LimitError(f"{where}: the JSON schema has more than "
                                 f"{limits.schema_nodes} subschemas")
            kids = [k for k in subschemas(node) if isinstance(k, dict)]
            _check_patterns(node, where, limits)
            target = _local_ref(schema, node.get("$ref")) if isinstance(node, dict) else None
            if isinstance(target, dict):
                kids.append(target)
            top[1] = kids
            on_path.add(id(node))
        if top[2] < len(kids):
            kid = kids[top[2]]
            top[2] += 1
            if id(kid) not in depth_of and id(kid) not in on_path:
                stack.append([kid, None, 0])
            continue
        # every child known: this node's depth is one more than its deepest child's (a $ref
        # stands for its target: no level of its own)
        own = 0 if isinstance(node, dict) and "$ref" in node else 1
        depth_of[id(node)] = own + max((depth_of.get(id(k), 0) for k in kids), default=0)
        if depth_of[id(node)] > limits.schema_depth:
            raise LimitError(f"{where}: the JSON schema nests more than "
                             f"{limits.schema_depth} levels (local $refs followed)")
        on_path.discard(id(node))
        stack.pop()
