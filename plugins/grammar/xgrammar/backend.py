"""The xgrammar backend (core.contract.grammar.GrammarBackend); imported only when it is chosen."""

from __future__ import annotations

import json
import re
from typing import Any

import xgrammar as xgr

from core.contract.grammar import Constraint, GrammarError, subschemas

# xgrammar's C++ errors start with "[hh:mm:ss] /path/file.cc:123: " (and "Check failed: ...: ")
_NOISE = re.compile(r"^\[[0-9:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")
_WHAT = {"json_schema": "invalid JSON schema", "json_object": "invalid JSON object grammar",
         "regex": "invalid regex", "ebnf": "invalid EBNF grammar", "choice": "invalid choices",
         "structural_tag": "invalid structural tag"}


def _clean(exc: Exception) -> str:
    return _NOISE.sub("", str(exc).strip()).strip().splitlines()[0][:300]


def _choice_ebnf(choices: list[str]) -> str:
    # JSON string escapes are EBNF string escapes for \", \\ and control characters
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


COMPACT = (",", ":")  # JSON item and key separators

# keywords that assert nothing (may sit beside anything)
_NOTES = {"title", "description", "default", "examples", "$comment", "$defs", "definitions",
          "$schema", "$id", "deprecated", "readOnly", "writeOnly"}
_JSON_TYPES = {"string": (str,), "boolean": (bool,), "null": (type(None),),
               "object": (dict,), "array": (list,)}


def _of_type(value: Any, types: Any) -> bool:
    """Whether a JSON value is of one of the schema `type`s."""
    for t in types if isinstance(types, list) else [types]:
        if t in ("integer", "number") and isinstance(value, (int, float)) \
                and not isinstance(value, bool):
            if t == "number" or float(value).is_integer():
                return True
        elif isinstance(value, _JSON_TYPES.get(t, ())):
            return True
    return False


def _loose(schema: Any, where: str = "the schema") -> str | None:
    """What xgrammar 0.2.9 would accept without enforcing in `schema` (checked by the grammar
    conformance suite): it compiles only one of anyOf / enum / const / $ref when other
    keywords assert beside them, one schema of allOf, multipleOf only on integers, and never
    a required name that properties does not define. None when it enforces all of it."""
    if not isinstance(schema, dict):
        return None
    asserts = set(schema) - _NOTES
    for key in ("anyOf", "$ref", "enum", "const"):
        if key not in schema:
            continue
        others = sorted(asserts - {key})
        if key in ("enum", "const") and others == ["type"]:
            values = schema["enum"] if key == "enum" else [schema["const"]]
            if all(_of_type(v, schema["type"]) for v in values if isinstance(values, list)):
                continue  # every value is of the type: the values alone are exact
        if others:
            return f"{key} beside {', '.join(others)} in {where}"
    if "multipleOf" in schema and schema.get("type") != "integer":
        return f"multipleOf on a non-integer type in {where}"
    if isinstance(schema.get("allOf"), list) and len(schema["allOf"]) > 1:
        return f"allOf of {len(schema['allOf'])} schemas in {where}"
    required, props = schema.get("required"), schema.get("properties") or {}
    if isinstance(required, list) and isinstance(props, dict):
        extra = [r for r in required if r not in props]
        if extra:
            return f"required {', '.join(map(str, extra))} outside properties in {where}"
    for sub in subschemas(schema):
        why = _loose(sub, "a subschema")
        if why:
            return why
    return None


class XGrammarMatcher:
    """One sequence's xgrammar GrammarMatcher under core.contract.grammar.GrammarMatcher. keep: (the
    bitmask row of tokens a JSON constraint may ever allow, ANDed into each row; the ids it
    leaves out, refused by accept), or None: any token."""

    def __init__(self, matcher: Any, keep: tuple[Any, frozenset[int]] | None = None):
        self.m = matcher
        self.keep, self.banned = keep if keep is not None else (None, frozenset())

    def fill_bitmask(self, bitmask: Any, row: int) -> None:
        self.m.fill_next_token_bitmask(bitmask, row)
        if self.keep is not None:
            bitmask[row] &= self.keep

    def accept(self, token: int) -> bool:
        token = int(token)
        if token in self.banned:
            return False
        return bool(self.m.accept_token(token))

    def is_terminated(self) -> bool:
        return bool(self.m.is_terminated())

    def jump_forward(self) -> list[int]:
        # greedy longest tokens over the forced text, the last one dropped where a longer
        # token extends it; no stop or special tokens; the matcher is not moved
        return list(self.m.find_jump_forward_tokens())

    def reset(self) -> None:
        self.m.reset()

    def close(self) -> None:
        self.m = None


class XGrammarBackend:
    """Constraints -> xgrammar CompiledGrammar for this tokenizer's vocabulary."""

    name = "xgrammar"

    def __init__(self, *, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]):
        self.tokenizer, self.vocab_size, self.stop = tokenizer, vocab_size, list(stop_token_ids)
        self._info: Any = None  # xgrammar's TokenizerInfo: validate needs no vocabulary
        self._compiler: Any = None  # built on the first compile
        self._no_control: Any = None  # the JSON keep (row, banned ids), built with the info

    def _grammar(self, c: Constraint, compiler: Any = None) -> Any:
        """xgrammar's Grammar (no compiler) or CompiledGrammar for `c`; JSON without free
        whitespace (small models loop on it) and compact separators, as the llguidance backend
        writes it (xgrammar's own default would demand ", " and ": "), strict objects for
        schemas as OpenAI's strict."""
        x = compiler or xgr.Grammar
        if c.kind == "json_schema":
            fn = x.compile_json_schema if compiler else x.from_json_schema
            return fn(c.value, any_whitespace=False, separators=COMPACT, strict_mode=True)
        if c.kind == "json_object":
            fn = x.compile_json_schema if compiler else x.from_json_schema
            return fn('{"type": "object"}', any_whitespace=False, separators=COMPACT,
                      strict_mode=False)
        if c.kind == "regex":
            return (x.compile_regex if compiler else x.from_regex)(c.value)
        if c.kind == "structural_tag":  # SGLang's / vLLM's shape: structures + triggers
            tag = json.loads(c.value)
            items = [xgr.StructuralTagItem(begin=t["begin"], schema=json.dumps(t["schema"]),
                                           end=t["end"]) for t in tag["structures"]]
            fn = x.compile_structural_tag if compiler else x.from_structural_tag
            return fn(items, list(tag["triggers"]))
        text = c.value if c.kind == "ebnf" else _choice_ebnf(c.choices())
        return (x.compile_grammar if compiler else x.from_ebnf)(text)

    def validate(self, constraint: Constraint) -> None:
        loose = _loose(constraint.schema()) if constraint.kind == "json_schema" else None
        if loose:
            raise GrammarError(f"{constraint.where}: the JSON schema uses {loose}, which grammar "
                               f"backend xgrammar cannot enforce")
        try:
            self._grammar(constraint)
        except (RuntimeError, ValueError, TypeError) as exc:
            raise GrammarError(f"{constraint.where}: {_WHAT[constraint.kind]}: "
                               f"{_clean(exc)}") from None

    def _vocabulary(self) -> Any:
        """The tokenizer info and the JSON keep row, built once."""
        if self._info is None:
            self._no_control = self._keep_row(lambda b: not any(c < 0x20 for c in b))
            self._info = self._tokenizer_info()
        return self._info

    def compile(self, constraint: Constraint) -> Any:
        if self._compiler is None:
            self._compiler = xgr.GrammarCompiler(self._vocabulary(), max_threads=2)
        try:
            compiled = self._grammar(constraint, self._compiler)
        except (RuntimeError, ValueError, TypeError) as exc:
            raise GrammarError(f"{constraint.where}: {_WHAT[constraint.kind]}: "
                               f"{_clean(exc)}") from None
        # compact JSON holds no raw control byte anywhere, but xgrammar 0.2.9 lets them into
        # strings with maxLength / minLength: such tokens are masked for JSON constraints
        json = constraint.kind in ("json_schema", "json_object")
        return compiled, self._no_control if json else None

    def serialize(self, compiled: Any) -> bytes:
        grammar, keep = compiled
        return json.dumps({"grammar": grammar.serialize_json(),
                           "json": keep is not None}).encode()

    def deserialize(self, data: bytes) -> Any:
        d = json.loads(data)
        grammar = xgr.CompiledGrammar.deserialize_json(d["grammar"], self._vocabulary())
        return grammar, self._no_control if d["json"] else None

    def _keep_row(self, ok: Any) -> tuple[Any, frozenset[int]]:
        """(A bitmask row [ceil(V / 32)] int32 allowing every token whose bytes pass ok(bytes),
        special and padding ids too: the grammar decides those; the ids it leaves out). Built
        in plain Python: it runs on the compile thread, where a parallel torch op would start a
        second OpenMP team that halves the speed of every later forward on a CPU (measured:
        16 -> 33 ms a SmolLM2 step on 2 cores)."""
        import torch

        n = min(self.vocab_size, len(self.tokenizer.hf))
        banned = frozenset(i for i in range(n)
                           if (b := self.tokenizer.token_bytes(i)) and not ok(b))
        words = [0xFFFFFFFF] * (-(-self.vocab_size // 32))  # every bit set
        for i in banned:
            words[i // 32] &= ~(1 << (i % 32))
        # as int32: two's complement of each word's 32 bits
        row = torch.tensor([w - (1 << 32) if w & (1 << 31) else w for w in words],
                           dtype=torch.int32)
        return row, banned

    def _tokenizer_info(self) -> Any:
        """xgrammar's view of the vocabulary, with the special tokens that are no stop token
        (<|im_start|>, tool and reserved markers) blanked: xgrammar reads a blank token as a
        control token, never allowed; from_huggingface would take their text for output text
        (allowed inside JSON strings and free text)."""
        hf = self.tokenizer.hf
        base = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=self.vocab_size,
                                                  stop_token_ids=self.stop or None)
        special = set(getattr(hf, "all_special_ids", ()))
        special |= {i for i, t in getattr(hf, "added_tokens_decoder", {}).items()
                    if getattr(t, "special", False)}
        special -= set(self.stop)
        if not special:
            return base
        vocab = [""] * self.vocab_size
        for text, i in hf.get_vocab().items():
            if i < self.vocab_size and i not in special:
                vocab[i] = text
        return xgr.TokenizerInfo(vocab, vocab_type=base.vocab_type, vocab_size=self.vocab_size,
                                 stop_token_ids=list(base.stop_token_ids),
                                 add_prefix_space=base.add_prefix_space)

    def matcher(self, compiled: Any) -> XGrammarMatcher:
        grammar, keep = compiled
        return XGrammarMatcher(xgr.GrammarMatcher(grammar), keep)
