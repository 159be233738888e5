"""Structured-output request fields -> one constraint (core.contract.grammar.Constraint as a dict).

The fields peers and OpenAI define, each read here and nowhere else:

    response_format {"type": "text" | "json_object" | "json_schema", "json_schema": {"name",
        "schema", "strict", "description"}}                        OpenAI, both routes
    regex, ebnf, json_schema (JSON text or object)                 SGLang (OpenAI routes, and
                                                                   /generate's sampling_params)
    guided_json, guided_regex, guided_choice, guided_grammar       vLLM
    structured_outputs {"json" | "regex" | "choice" | "grammar" | "json_object"}   vLLM

At most one constraint per request (two are a 400 naming both). The value's shape is checked
here; whether the engine's grammar backend can compile it is checked by the engine before
admission (a 400 naming the problem), and structured output being off is a 400 too.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from core.server.errors import invalid

if TYPE_CHECKING:
    from core.contract.json_types import JSON, JSONObject

# top-level fields of the OpenAI routes, and what constraint kind each gives
OPENAI_FIELDS = {"response_format": None, "regex": "regex", "ebnf": "ebnf",
                 "json_schema": "json_schema", "guided_json": "json_schema",
                 "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "ebnf",
                 "structured_outputs": None}
# SGLang's keys inside /generate's sampling_params
NATIVE_FIELDS = {"regex": "regex", "ebnf": "ebnf", "json_schema": "json_schema"}
STRUCTURED_OUTPUTS_KEYS = {"json": "json_schema", "regex": "regex", "choice": "choice",
                           "grammar": "ebnf", "json_object": "json_object"}
JSON_SCHEMA_KEYS = ("name", "schema", "strict", "description")


def _value(kind: str, v: JSON, param: str) -> dict[str, str]:
    """One field's value as a constraint dict (shape checks only)."""
    if kind == "json_schema":
        if isinstance(v, str):
            try:
                v = json.loads(v)
            except ValueError as e:
                raise invalid(param, f"{param}: invalid JSON schema: not JSON ({e})") from None
        if not isinstance(v, (dict, bool)):
            raise invalid(param, f"{param}: invalid JSON schema: a schema is an object or a "
                          "boolean", code="invalid_type")
        return {"kind": kind, "value": json.dumps(v), "source": param}
    if kind == "json_object":
        if v is not True:
            raise invalid(param, f"{param} must be true", code="invalid_type")
        return {"kind": kind, "value": "", "source": param}
    if kind == "choice":
        if not (isinstance(v, list) and v and all(isinstance(x, str) and x for x in v)):
            raise invalid(param, f"{param} must be a non-empty array of non-empty strings",
                          code="invalid_type")
        return {"kind": kind, "value": json.dumps(v), "source": param}
    if not isinstance(v, str) or not v:
        raise invalid(param, f"{param} must be a non-empty string", code="invalid_type")
    return {"kind": kind, "value": v, "source": param}


def _response_format(v: JSON) -> dict[str, str] | None:
    p = "response_format"
    if not isinstance(v, dict) or not isinstance(v.get("type"), str):
        raise invalid(p, f"{p} must be an object with a type", code="invalid_type")
    kind = v["type"]
    if kind == "structural_tag":  # SGLang's / vLLM's: structures + triggers (xgrammar)
        extra = sorted(set(v) - {"type", "structures", "triggers"})
        if extra:
            raise invalid(f"{p}.{extra[0]}", f"unknown parameter {p}.{extra[0]} for type "
                          "'structural_tag' (it takes structures and triggers)",
                          code="unknown_parameter")
        return {"kind": "structural_tag", "source": p, "value": json.dumps(
            {"structures": v.get("structures"), "triggers": v.get("triggers")})}
    extra = sorted(set(v) - {"type", "json_schema"})
    if extra or ("json_schema" in v and kind != "json_schema"):
        bad = extra[0] if extra else "json_schema"
        raise invalid(f"{p}.{bad}", f"unknown parameter {p}.{bad} for type {kind!r}",
                      code="unknown_parameter")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"kind": "json_object", "value": "", "source": p}
    if kind != "json_schema":
        raise invalid(f"{p}.type", f"{p}.type {kind!r:.40} is not supported (text, json_object, "
                      "json_schema, structural_tag)", code="unsupported")
    js = v.get("json_schema")
    if not isinstance(js, dict):
        raise invalid(f"{p}.json_schema", f"{p}.json_schema must be an object with the schema",
                      code="missing_required_parameter" if js is None else "invalid_type")
    for key in js:
        if key not in JSON_SCHEMA_KEYS:
            raise invalid(f"{p}.json_schema.{key}", f"unknown parameter {p}.json_schema."
                          f"{key}: it takes {', '.join(JSON_SCHEMA_KEYS)}",
                          code="unknown_parameter")
    for key, want in (("name", str), ("description", str), ("strict", bool)):
        if js.get(key) is not None and not isinstance(js[key], want):
            raise invalid(f"{p}.json_schema.{key}", f"{p}.json_schema.{key} must be a "
                          f"{'string' if want is str else 'boolean'}", code="invalid_type")
    if "schema" not in js:
        raise invalid(f"{p}.json_schema.schema", f"{p}.json_schema.schema is required",
                      code="missing_required_parameter")
    # strict or not, the schema is enforced by the grammar (strict is what is served)
    return _value("json_schema", js["schema"], f"{p}.json_schema.schema")


def _structured_outputs(v: JSON) -> list[dict[str, str]]:
    p = "structured_outputs"
    if not isinstance(v, dict):
        raise invalid(p, f"{p} must be an object", code="invalid_type")
    out = []
    for key, val in v.items():
        if key not in STRUCTURED_OUTPUTS_KEYS:
            raise invalid(f"{p}.{key}", f"{p}.{key} is not supported (this server takes "
                          f"{', '.join(STRUCTURED_OUTPUTS_KEYS)})", code="unsupported")
        if val is None or val is False:
            continue
        out.append(_value(STRUCTURED_OUTPUTS_KEYS[key], val, f"{p}.{key}"))
    return out


def constraint_of(body: JSONObject, fields: dict[str, str | None],
                  prefix: str = "") -> dict[str, str] | None:
    """The one constraint `body`'s structured-output fields ask for (None: none); 400 for a
    malformed value or for two constraints."""
    found: list[dict[str, str]] = []
    for name, kind in fields.items():
        v = body.get(name)
        if v is None:
            continue
        if name == "response_format":
            c = _response_format(v)
            found += [c] if c else []
        elif name == "structured_outputs":
            found += _structured_outputs(v)
        else:
            found.append(_value(kind or "", v, prefix + name))
    if len(found) > 1:
        names = " and ".join(c["source"] for c in found)
        raise invalid(found[1]["source"], f"give one structured-output constraint, not "
                      f"several: got {names}")
    return found[0] if found else None
