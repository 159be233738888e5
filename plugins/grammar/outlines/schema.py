"""What outlines-core 0.2.14's JSON-schema translation would get wrong, found before it runs.

outlines_core.json_schema translates one schema object by its first keyword among properties,
allOf, anyOf, oneOf, prefixItems, enum, const, $ref, type (that branch alone), and within type
by the first of minLength/maxLength, pattern, format for strings. Any other constraining keyword
beside it is dropped. `problems` walks a schema the way the translation does and names every
keyword that would be dropped, and the shapes it writes wrongly: allOf of several schemas (their
texts one after the other), property names and constant objects' keys it pastes unescaped,
recursive $refs (cut at a depth, dropping required properties), `required` naming a property it
never writes. `prepared` gives the schema to translate: each untyped subschema `{}` wrapped as
anyOf [{}] (written bare, its alternatives leak out of a property: `{"a":` ... `|null|` ...).
"""

from __future__ import annotations

import re
from typing import Any

# JSON-schema keywords that constrain an instance (annotations and unknown keywords do not)
CONSTRAINING = frozenset({
    "type", "enum", "const", "multipleOf", "maximum", "exclusiveMaximum", "minimum",
    "exclusiveMinimum", "maxLength", "minLength", "pattern", "format", "maxItems", "minItems",
    "uniqueItems", "maxContains", "minContains", "contains", "items", "prefixItems",
    "additionalItems", "unevaluatedItems", "maxProperties", "minProperties", "required",
    "dependentRequired", "dependencies", "properties", "patternProperties",
    "additionalProperties", "propertyNames", "unevaluatedProperties", "allOf", "anyOf", "oneOf",
    "not", "if", "then", "else", "dependentSchemas", "$ref", "$dynamicRef", "$recursiveRef",
    "contentEncoding", "contentMediaType", "contentSchema"})
BRANCHES = ("properties", "allOf", "anyOf", "oneOf", "prefixItems", "enum", "const", "$ref",
            "type")
_BY_TYPE = {"object": {"minProperties", "maxProperties", "additionalProperties"},
            "array": {"items", "minItems", "maxItems"}}
_SAFE_KEY = re.compile(r"[A-Za-z0-9_ -]*")  # neither JSON nor regex escapes them
_JSON_ESCAPED = re.compile(r'["\\\x00-\x1f]')
INVALID = "invalid: "  # a problem that makes the schema invalid, not just unenforced


def _types(s: dict) -> set[str]:
    t = s.get("type")
    return {t} if isinstance(t, str) else {x for x in t if isinstance(x, str)} \
        if isinstance(t, list) else set()


def _json_type_fits(value: Any, types: set[str]) -> bool:
    if isinstance(value, bool):
        kinds = {"boolean"}
    elif isinstance(value, int):
        kinds = {"integer", "number"}
    elif isinstance(value, float):
        kinds = {"number"} | ({"integer"} if value.is_integer() else set())
    else:
        kinds = {{str: "string", list: "array", dict: "object", type(None): "null"}.get(
            type(value), "?")}
    return bool(kinds & types)


def _keys_unsafe(value: Any) -> list[str]:
    if isinstance(value, dict):
        return [k for k in value if not _SAFE_KEY.fullmatch(k)] + \
            [k for v in value.values() for k in _keys_unsafe(v)]
    if isinstance(value, list):
        return [k for v in value for k in _keys_unsafe(v)]
    return []


def _honoured(s: dict, branch: str) -> set[str]:
    """The keywords the translation reads when it takes `branch` for the schema object `s`."""
    if branch == "properties":
        return {"properties", "required", "type", "additionalProperties"}
    if branch == "prefixItems":
        return {"prefixItems", "items", "type"}
    if branch in ("enum", "const"):
        return {branch, "type"}
    if branch != "type":
        return {branch}
    got = {"type"}
    for t in _types(s):
        if t == "string":
            got |= ({"minLength", "maxLength"} & set(s)) or ({"pattern"} & set(s)) or \
                ({"format"} & set(s))
        got |= _BY_TYPE.get(t, set())
    return got


def problems(root: Any) -> list[str]:
    """What the translation of `root` would drop or get wrong ([] when nothing); an item
    starting with INVALID is an error in the schema itself."""
    found: list[str] = []

    def walk(s: Any, at: str, refs: tuple[str, ...]) -> None:
        if not isinstance(s, dict) or not s:
            return  # {} is any value; booleans and the rest outlines-core refuses itself
        branch = next((b for b in BRANCHES if b in s), None)
        if branch is None:
            return  # outlines-core refuses it ("Unsupported JSON Schema structure")
        dropped = sorted((CONSTRAINING & set(s)) - _honoured(s, branch))
        if dropped:
            found.append(f"{', '.join(dropped)} beside {branch} (at {at or '/'})")
        types = _types(s)
        if branch == "properties":
            props = s["properties"] if isinstance(s["properties"], dict) else {}
            if "type" in s and "object" not in types:
                found.append(f"properties with type {s['type']} (at {at or '/'})")
            missing = [r for r in s.get("required") or () if r not in props]
            if missing:
                found.append(f"required {', '.join(map(str, missing))} outside properties "
                             f"(at {at or '/'})")
            for name, sub in props.items():
                if _JSON_ESCAPED.search(name):
                    found.append(f"a property name JSON escapes, {name!r} (at {at or '/'})")
                walk(sub, f"{at}/properties/{name}", refs)
        elif branch in ("allOf", "anyOf", "oneOf", "prefixItems"):
            subs = s[branch] if isinstance(s[branch], list) else []
            if branch == "allOf" and len(subs) > 1:
                found.append(f"allOf of {len(subs)} schemas (at {at or '/'})")
            if branch == "prefixItems" and "type" in s and "array" not in types:
                found.append(f"prefixItems with type {s['type']} (at {at or '/'})")
            for i, sub in enumerate(subs):
                walk(sub, f"{at}/{branch}/{i}", refs)
        elif branch in ("enum", "const"):
            values = s[branch] if branch == "const" else s["enum"]
            values = [values] if branch == "const" else values if isinstance(values, list) else []
            if "type" in s and not all(_json_type_fits(v, types) for v in values):
                found.append(f"{branch} values outside type {s['type']} (at {at or '/'})")
            unsafe = [k for v in values for k in _keys_unsafe(v)]
            if unsafe:
                found.append(f"{branch} objects with keys {unsafe[0]!r} it would not escape "
                             f"(at {at or '/'})")
        elif branch == "$ref":
            ref = s["$ref"]
            if isinstance(ref, str) and ref in refs:
                found.append(f"a recursive $ref {ref} (at {at or '/'})")
                return
            target = _resolve(root, ref)
            if target is not None:
                walk(target, f"{at}/$ref", (*refs, ref))
        else:  # type
            for key, t in (("additionalProperties", "object"), ("items", "array")):
                if t in types and isinstance(s.get(key), dict):
                    walk(s[key], f"{at}/{key}", refs)
            for k in ("minLength", "maxLength") if "string" in types else ():
                v = s.get(k, 0)
                if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0 or \
                        v != int(v):
                    found.append(f"{INVALID}{k} must be a non-negative integer (at {at or '/'})")
                elif isinstance(v, float):  # 2.0: read as no bound
                    found.append(f"{k} written as a float (at {at or '/'})")

    walk(root, "", ())
    return found


def _resolve(root: Any, ref: Any) -> Any:
    """A local $ref's target (None when outlines-core would refuse it)."""
    if not isinstance(ref, str) or "#" not in ref or ref.split("#")[0]:
        return None
    node = root
    for part in (p for p in ref.split("#", 1)[1].split("/") if p):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def ref_depth(root: Any) -> int:
    """The longest chain of nested $refs (problems() has refused cycles)."""
    def depth(s: Any, seen: tuple[str, ...]) -> int:
        if isinstance(s, list):
            return max((depth(x, seen) for x in s), default=0)
        if not isinstance(s, dict):
            return 0
        best = 0
        ref = s.get("$ref")
        if isinstance(ref, str) and ref not in seen:
            best = 1 + depth(_resolve(root, ref), (*seen, ref))
        for k, v in s.items():
            if k not in ("$defs", "definitions", "enum", "const", "$ref"):
                best = max(best, depth(v, seen))
        return best

    return depth(root, ())


_SCHEMA_MAPS = ("properties", "$defs", "definitions")
_SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems")
_SCHEMA_ONE = ("additionalProperties", "items")


def prepared(s: Any, top: bool = True) -> Any:
    """A copy of the schema with every untyped subschema {} (not the root) as anyOf [{}]."""
    if not isinstance(s, dict):
        return s
    if not s:
        return s if top else {"anyOf": [{}]}
    out = dict(s)
    for k in _SCHEMA_MAPS:
        if isinstance(s.get(k), dict):
            out[k] = {n: prepared(v, False) for n, v in s[k].items()}
    for k in _SCHEMA_LISTS:
        if isinstance(s.get(k), list):
            out[k] = [prepared(v, False) for v in s[k]]
    for k in _SCHEMA_ONE:
        if isinstance(s.get(k), dict):
            out[k] = prepared(s[k], False)
    return out
