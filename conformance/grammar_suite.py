"""The grammar-backend conformance tests (core/contract/grammar.py): a backend's token masks against a
brute-force check over every token of a small vocabulary, its matchers' protocol, its refusals.

Collected by the conformance plugin (`pytest --conformance-grammar NAME`, see
conformance.plugin), or by importing them into a test module:

    from conformance.grammar_suite import *  # noqa: F401,F403

Parametrization: every registered grammar backend whose packages are installed (or only those
named; a named one that cannot run is one skip with the reason) x every case of a constraint
type it declares (GrammarCaps.constraints) whose schema uses no keyword it declares lacking
(GrammarCaps.schema_lacks). For a named backend, each constraint type it does not declare and
each case cut by its schema_lacks is one skip with the reason (`pytest -rs` lists them).

The vocabulary (SuiteVocab): a byte-level tokenizer whose ids 0..255 are the bytes, then
multi-byte tokens (so that a token may cross the end of a word, or spell part of a UTF-8
character), then special tokens: two stop tokens and a control token; the logits are wider
than the tokenizer. JSON is compact, as the built-in backends write it: no whitespace between
tokens, separators "," and ":".

Checks, per case (a constraint and the language it defines): along several words of the
language, each walked twice (shortest and longest allowed tokens), at every prefix:
- the mask from fill_bitmask is the set of tokens whose bytes keep a valid prefix, plus the stop
  tokens where the text is complete (every stop token, never a control token or a padding id).
  Languages the suite cannot enumerate (any JSON object) are checked one way only: no token
  outside the language, every token that continues one of the case's words. Where the grammar
  forces the next bytes, a backend may allow just one token of them instead (the tokenization
  it prefers, as llguidance does for a canonical tokenizer);
- every allowed token is accepted (a replay on a second matcher), every other token refused
  with the state unchanged, and is_terminated stays False until a stop token is accepted;
- after the stop token the matcher is terminated and refuses everything; reset() restarts it;
- where the backend declares jump_forward (GrammarCaps): jump_forward() leaves the matcher as it
  was, returns ordinary tokens only, which the matcher accepts in order, and whose bytes every
  continuation of the prefix starts with (languages the suite cannot enumerate: keep it valid).
Per backend: fill_bitmask writes its own row, all of it; matchers of one compiled grammar are
independent (n > 1) and close() of one leaves the others working; invalid constraints of every
declared type raise GrammarError from validate and from compile, naming the request field; a
backend declaring jump_forward jumps somewhere along the cases' words (it is not always []).
Per JSON-schema keyword (KEYWORDS): one the backend does not declare in schema_lacks is either
refused by the backend (GrammarError) or enforced (a text violating it refused, one satisfying
it accepted); one it declares is refused by the core (core.contract.grammar.Grammar.check), wherever in
the schema it sits.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache

import pytest
import torch

from conformance.attention_suite import named_plugins
from core.contract.grammar import Constraint, Grammar, GrammarError, make_grammar, schema_keywords
from core.plan.checks import missing_packages
from core.plan.registry import get_registry

__all__ = ["pytest_generate_tests", "test_grammar_case_conformance",
           "test_grammar_protocol_conformance", "test_grammar_keyword_conformance"]

# -- the vocabulary -------------------------------------------------------------------------------

# multi-byte tokens: parts of the cases' words, tokens that overrun a word's end ("le!", "d!"),
# a two-byte UTF-8 character
MULTI = ("ap", "ple", "pri", "cot", "ki", "wi", "ab", "bd", "cd", "xy", "zz", "qq", "12", "00",
         "é", "le!", "d!", '"o', 'n"', "ff", '{"', '":', '",', '"}', "true", "fal", "se",
         "null", "[1", ",2", "]}", "\\n")
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
PADDING = 5  # logits past the tokenizer, as models pad their vocabulary


@dataclass(frozen=True)
class SuiteVocab:
    tokenizer: object  # core.tokenizer.Tokenizer
    size: int  # the logits width
    stops: tuple[int, ...]  # the stop tokens given to the factory
    bytes_of: dict[int, bytes]  # every ordinary token's bytes
    never: frozenset[int]  # control tokens and padding ids: never allowed


@lru_cache(maxsize=1)
def suite_vocab() -> SuiteVocab:
    """The suite's tokenizer (written to a temporary directory and loaded back)."""
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from core.tokenizer import Tokenizer, _gpt2_byte_alphabet

    alphabet = _gpt2_byte_alphabet()
    vocab = {alphabet[b]: b for b in range(256)}
    for text in MULTI:
        vocab["".join(alphabet[b] for b in text.encode())] = len(vocab)
    for s in SPECIALS:
        vocab[s] = len(vocab)
    raw = RawTokenizer(models.BPE(vocab=vocab, merges=[]))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    raw.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token=SPECIALS[1],
                                   eos_token=SPECIALS[2], additional_special_tokens=SPECIALS)
    with tempfile.TemporaryDirectory(prefix="grammar-suite-") as path:
        fast.save_pretrained(path)
        tok = Tokenizer.from_path(path)
    n = len(tok.hf)
    ordinary = {i: tok.token_bytes(i) for i in range(n - len(SPECIALS))}
    stops = (n - 1, n - 3)  # <|im_end|>, <|endoftext|>
    return SuiteVocab(tok, n + PADDING, stops, ordinary,
                      frozenset({n - 2, *range(n, n + PADDING)}))


_GRAMMARS: dict[str, Grammar] = {}


def suite_grammar(name: str) -> Grammar:
    """The registered backend `name` built over the suite's vocabulary (once per process)."""
    if name not in _GRAMMARS:
        v = suite_vocab()
        _GRAMMARS[name] = make_grammar(get_registry(), name, v.tokenizer, v.size, list(v.stops))
    return _GRAMMARS[name]


def allowed(matcher, size: int, fill: int = 0) -> set[int]:
    """The tokens matcher.fill_bitmask allows (row 0 of a one-row bitmask filled with `fill`
    beforehand)."""
    words = -(-size // 32)
    bitmask = torch.full((1, words), fill, dtype=torch.int32)
    matcher.fill_bitmask(bitmask, 0)
    row = bitmask[0].tolist()
    return {t for t in range(size) if (row[t // 32] >> (t % 32)) & 1}


# -- languages ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Language:
    """What a constraint defines, as an oracle over bytes: state(text) -> (viable, complete)
    (text is a prefix of a word; text is a word). words: texts walked, which the mask must let
    through. exact: the mask must allow every viable token (False: the oracle is a superset the
    backend may narrow, e.g. a JSON object nesting limit)."""

    state: Callable[[bytes], tuple[bool, bool]]
    words: tuple[bytes, ...]
    exact: bool = True


def finite(*words: str) -> Language:
    ws = tuple(w.encode() for w in words)
    return Language(lambda t: (any(w.startswith(t) for w in ws), t in ws), ws)


def regular(pattern: str, *words: str, exact: bool = True) -> Language:
    """A language given by a bytes regex (the `regex` package, whose partial matches tell a
    viable prefix); pattern is matched whole."""
    import regex

    rx = regex.compile(pattern.encode())

    def state(t: bytes) -> tuple[bool, bool]:
        return rx.fullmatch(t, partial=True) is not None, rx.fullmatch(t) is not None

    return Language(state, tuple(w.encode() for w in words), exact)


def json_objects(*words: str) -> Language:
    return Language(lambda t: json_state(t, root_object=True), tuple(w.encode() for w in words),
                    exact=False)


def json_state(text: bytes, root_object: bool = False) -> tuple[bool, bool]:
    """(viable, complete) for compact JSON (RFC 8259 without whitespace, strict UTF-8)."""
    p = _JsonPrefix(root_object)
    for b in text:
        if not p.feed(b):
            return False, False
    return True, p.complete()


class _JsonPrefix:
    """A byte-at-a-time JSON recognizer: a stack of containers and the token being read."""

    def __init__(self, root_object: bool):
        self.stack: list[str] = []  # "{" / "[" for each open container
        # what comes next: value, key (after "{" or ","), colon, after (a value in a container)
        self.expect = "object" if root_object else "value"
        self.done = False  # the root value is complete
        self.tok = ""  # "", "str", "num", "lit"
        self.sub = ""  # string: "", "esc", "u1".."u4", "utf"; number: its state
        self.need = 0  # UTF-8 continuation bytes still needed
        self.lo, self.hi = 0x80, 0xBF  # the range of the next continuation byte
        self.rest = b""  # a literal's remaining bytes
        self.key = False  # the string being read is an object key

    def complete(self) -> bool:
        return self.done or (not self.stack and self.tok == "num" and self.sub in _NUM_END)

    def _value_done(self) -> None:
        self.tok = ""
        if self.stack:
            self.expect = "after"
        else:
            self.done = True

    def feed(self, b: int) -> bool:
        if self.tok == "str":
            return self._string(b)
        if self.tok == "lit":
            if not self.rest or b != self.rest[0]:
                return False
            self.rest = self.rest[1:]
            if not self.rest:
                self._value_done()
            return True
        if self.tok == "num":
            nxt = _NUM.get(self.sub, {}).get(_num_class(b))
            if nxt is not None:
                self.sub = nxt
                return True
            if self.sub not in _NUM_END:
                return False
            self._value_done()  # the number ends here; b is structural
        if self.done:
            return False
        return self._structural(b)

    def _structural(self, b: int) -> bool:
        c = chr(b)
        e = self.expect
        if e == "colon":
            if c != ":":
                return False
            self.expect = "value"
            return True
        if e == "after":
            top = self.stack[-1]
            if c == ",":
                self.expect = "key" if top == "{" else "value"
                return True
            if c == ("}" if top == "{" else "]"):
                self.stack.pop()
                self._value_done()
                return True
            return False
        if e in ("key", "key_or_end"):
            if c == "}" and e == "key_or_end":
                self.stack.pop()
                self._value_done()
                return True
            if c != '"':
                return False
            self.tok, self.sub, self.key = "str", "", True
            return True
        if e == "object" and c != "{":
            return False
        if e == "value_or_end" and c == "]":
            self.stack.pop()
            self._value_done()
            return True
        # a value
        if c == "{":
            self.stack.append("{")
            self.expect = "key_or_end"
        elif c == "[":
            self.stack.append("[")
            self.expect = "value_or_end"
        elif c == '"':
            self.tok, self.sub, self.key = "str", "", False
        elif c in "-0123456789":
            self.tok, self.sub = "num", _NUM["start"][_num_class(b)]
        elif c in "tfn":
            self.tok, self.rest = "lit", {"t": b"rue", "f": b"alse", "n": b"ull"}[c]
        else:
            return False
        return True

    def _string(self, b: int) -> bool:
        s = self.sub
        if s == "utf":
            if not self.lo <= b <= self.hi:
                return False
            self.lo, self.hi = 0x80, 0xBF
            self.need -= 1
            if not self.need:
                self.sub = ""
            return True
        if s == "esc":
            if chr(b) in '"\\/bfnrt':
                self.sub = ""
            elif b == ord("u"):
                self.sub = "u4"
            else:
                return False
            return True
        if s.startswith("u"):
            if chr(b) not in "0123456789abcdefABCDEF":
                return False
            left = int(s[1]) - 1
            self.sub = f"u{left}" if left else ""
            return True
        if b == ord('"'):
            if self.key:
                self.tok, self.expect = "", "colon"
            else:
                self._value_done()
            return True
        if b == ord("\\"):
            self.sub = "esc"
            return True
        if b < 0x20:
            return False
        if b < 0x80:
            return True
        # a UTF-8 lead byte (RFC 3629: no overlong forms, no surrogates, at most U+10FFFF)
        if 0xC2 <= b <= 0xDF:
            self.need, self.lo, self.hi = 1, 0x80, 0xBF
        elif 0xE0 <= b <= 0xEF:
            self.need = 2
            self.lo, self.hi = {0xE0: (0xA0, 0xBF), 0xED: (0x80, 0x9F)}.get(b, (0x80, 0xBF))
        elif 0xF0 <= b <= 0xF4:
            self.need = 3
            self.lo, self.hi = {0xF0: (0x90, 0xBF), 0xF4: (0x80, 0x8F)}.get(b, (0x80, 0xBF))
        else:
            return False
        self.sub = "utf"
        return True


def _num_class(b: int) -> str:
    c = chr(b)
    if c == "0":
        return "0"
    if c in "123456789":
        return "d"
    return {"-": "-", "+": "+", ".": ".", "e": "e", "E": "e"}.get(c, "x")


# JSON number states: state -> {byte class: next state}; _NUM_END: where a number may end
_NUM = {
    "start": {"-": "minus", "0": "zero", "d": "int"},
    "minus": {"0": "zero", "d": "int"},
    "zero": {".": "dot", "e": "exp"},
    "int": {"0": "int", "d": "int", ".": "dot", "e": "exp"},
    "dot": {"0": "frac", "d": "frac"},
    "frac": {"0": "frac", "d": "frac", "e": "exp"},
    "exp": {"+": "sign", "-": "sign", "0": "edig", "d": "edig"},
    "sign": {"0": "edig", "d": "edig"},
    "edig": {"0": "edig", "d": "edig"},
}
_NUM_END = frozenset({"zero", "int", "frac", "edig"})


# -- the cases ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class GrammarCase:
    id: str
    constraint: Constraint
    language: Language

    @property
    def keywords(self) -> set[str]:
        return schema_keywords(self.constraint.schema()) if \
            self.constraint.kind == "json_schema" else set()


def _schema(s: object) -> Constraint:
    return Constraint("json_schema", json.dumps(s), source="json_schema")


CASES = (
    GrammarCase("choice-fruits", Constraint("choice", json.dumps(
        ["apple", "apricot", "kiwi", "é!"]), source="choice"),
        finite("apple", "apricot", "kiwi", "é!")),
    GrammarCase("choice-prefixes-and-metacharacters", Constraint("choice", json.dumps(
        ["ab", "abd", "a.b", "(x)|y", 'q"\\', "1+2*"]), source="choice"),
        finite("ab", "abd", "a.b", "(x)|y", 'q"\\', "1+2*")),
    GrammarCase("regex-finite", Constraint("regex", "a[bc]d?", source="regex"),
                finite("ab", "ac", "abd", "acd")),
    GrammarCase("regex-repeat", Constraint("regex", "(ab|cd)+x?|q+", source="regex"),
                regular(r"(?:ab|cd)+x?|q+", "ab", "abcdx", "cdab", "qqqq", "q")),
    GrammarCase("regex-counted", Constraint("regex", "[0-9]{2}-[a-c]{1,2}", source="regex"),
                regular(r"[0-9]{2}-[a-c]{1,2}", "12-a", "00-cb", "90-bb")),
    GrammarCase("regex-escapes-and-utf8", Constraint("regex", r"é+|e\.\n", source="regex"),
                regular(r"(?:é)+|e\.\n", "é", "ééé", "e.\n")),
    GrammarCase("ebnf-alternatives", Constraint("ebnf", 'root ::= "x" ("y" | "zz")',
                                                source="ebnf"), finite("xy", "xzz")),
    GrammarCase("ebnf-recursive", Constraint("ebnf", 'root ::= "(" root ")" | "ab"',
                                             source="ebnf"),
                regular(r"(\((?1)\)|ab)", "ab", "(ab)", "(((ab)))")),
    GrammarCase("json_schema-enum", _schema({"enum": ["on", "off"]}), finite('"on"', '"off"')),
    GrammarCase("json_schema-object", _schema({
        "type": "object", "properties": {"ok": {"type": "boolean"}, "c": {"enum": ["x", 1]}},
        "required": ["ok", "c"], "additionalProperties": False}),
        finite(*(f'{{"ok":{b},"c":{c}}}' for b in ("true", "false") for c in ('"x"', "1")))),
    # a string of at most 3 characters: escapes and UTF-8 characters count one each, raw
    # control bytes are never JSON (xgrammar 0.2.9 let them into a maxLength string)
    GrammarCase("json_schema-short-string", _schema({
        "type": "object", "properties": {"s": {"type": "string", "maxLength": 3}},
        "required": ["s"], "additionalProperties": False}),
        regular(r'\{"s":"(?:[\x20\x21\x23-\x5b\x5d-\x7f]|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4}'
                r'|[\xc2-\xf4][\x80-\xbf]{1,3}){0,3}"\}',
                '{"s":""}', '{"s":"ab"}', '{"s":"a\\nb"}', '{"s":"é!"}', exact=False)),
    GrammarCase("json_schema-integer", _schema({"type": "integer"}),  # "-0": either way
                regular(r"-?(?:0|[1-9][0-9]*)", "0", "-12", "1200", "7", exact=False)),
    GrammarCase("json_schema-array", _schema({
        "type": "array", "items": {"enum": [1, 2]}, "minItems": 1, "maxItems": 2}),
        finite("[1]", "[2]", "[1,1]", "[1,2]", "[2,1]", "[2,2]")),
    GrammarCase("json_schema-nullable-ref", _schema({
        "$defs": {"b": {"type": "boolean"}}, "anyOf": [{"$ref": "#/$defs/b"}, {"type": "null"}]}),
        finite("true", "false", "null")),
    GrammarCase("structural_tag", Constraint("structural_tag", json.dumps({
        "structures": [{"begin": "<f>", "schema": {"type": "object", "properties": {
            "a": {"type": "integer"}}, "required": ["a"], "additionalProperties": False},
            "end": "</f>"}], "triggers": ["<f>"]}), source="response_format"),
        # free text in which "<f>" opens the tagged JSON (whitespace as JSON allows it)
        regular(r'(?:(?:(?!<f>)[\x00-\xff])|<f>\s*\{\s*"a"\s*:\s*-?(?:0|[1-9][0-9]*)\s*\}\s*'
                r'</f>)*',
                "hi", 'x <f>{"a":1}</f> y', '<f>{"a": -20}</f><f>{"a":0}</f>', exact=False)),
    GrammarCase("json_object", Constraint("json_object", source="response_format"),
                json_objects("{}", '{"a":1}', '{"k":"v\\n\\"é","n":[1,2,{"x":null}],'
                             '"t":true,"f":false}', '{"neg":-3.5,"s":""}')),
)

# invalid constraints of each type (json_object and choice have none past Constraint.validate)
INVALID = {
    "json_schema": ('{"type": "nonsense"}',),
    "regex": ("a(b", "[z-a]"),
    "ebnf": ("root ::= missing", 'root ::= ("a"'),
}


# -- JSON-schema keywords -------------------------------------------------------------------------

@dataclass(frozen=True)
class KeywordCase:
    keyword: str
    schema: dict
    violations: tuple[str, ...]  # compact JSON texts the keyword forbids
    satisfying: tuple[str, ...] = ()  # compact JSON texts it allows
    id: str = ""


def _texts(x: str | tuple[str, ...]) -> tuple[str, ...]:
    return (x,) if isinstance(x, str) else tuple(x)


def _kw(keyword: str, schema: dict, violations, satisfying=(), id: str = "") -> KeywordCase:
    return KeywordCase(keyword, schema, _texts(violations), _texts(satisfying), id or keyword)


_INT = {"type": "integer"}
KEYWORDS = (
    _kw("type", {"type": "integer"}, ('"1"', "1.5", "null"), ("3",)),
    _kw("enum", {"enum": ["a", 1]}, ('"b"', "2"), ('"a"', "1")),
    _kw("const", {"const": "a"}, '"b"', '"a"'),
    _kw("minLength", {"type": "string", "minLength": 3}, '"ab"', '"abc"'),
    _kw("maxLength", {"type": "string", "maxLength": 2}, '"abc"', '"ab"'),
    _kw("pattern", {"type": "string", "pattern": "^a+$"}, ('"b"', '"ab"'), '"aa"'),
    _kw("pattern", {"type": "string", "pattern": "^.$"}, '"""', '"x"', id="pattern-quote"),
    _kw("pattern", {"type": "string", "pattern": "^a+$", "maxLength": 3}, '"b"', '"aa"',
        id="pattern-with-length"),
    _kw("format", {"type": "string", "format": "date"},
        ('"x"', '"2024-13-01"', '"\u0662\u0660\u0662\u0664-01-01"'), '"2024-02-29"'),
    _kw("format", {"type": "string", "format": "date-time"},
        ('"2024-01-01"', '"2024-01-01T10:00:00"'), '"2024-01-01T10:00:00Z"', id="format-date-time"),
    _kw("format", {"type": "string", "format": "time"}, ('"10:00:00\\a1Z"', '"25:00:00Z"'),
        '"10:00:00Z"', id="format-time"),
    _kw("minimum", {"type": "integer", "minimum": 5}, "4", "5"),
    _kw("maximum", {"type": "integer", "maximum": 5}, "6", "5"),
    _kw("exclusiveMinimum", {"type": "integer", "exclusiveMinimum": 5}, "5", "6"),
    _kw("exclusiveMaximum", {"type": "number", "exclusiveMaximum": 5}, "5", "4.5"),
    _kw("multipleOf", {"type": "integer", "multipleOf": 3}, "4", "6"),
    _kw("multipleOf", {"type": "number", "multipleOf": 0.5}, ("0.3", "1.25"), ("1.5", "2"),
        id="multipleOf-number"),
    _kw("items", {"type": "array", "items": {"type": "integer"}}, '["a"]', "[1,2]"),
    _kw("minItems", {"type": "array", "items": _INT, "minItems": 2}, "[1]", "[1,2]"),
    _kw("maxItems", {"type": "array", "items": {"type": "integer"}, "maxItems": 1}, "[1,2]",
        "[1]"),
    _kw("uniqueItems", {"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
        "[1,1]", "[1,2]"),
    _kw("contains", {"type": "array", "items": {"type": ["integer", "string"]},
                     "contains": {"type": "string"}}, "[1]", '["a"]'),
    _kw("prefixItems", {"type": "array", "prefixItems": [{"type": "integer"}], "items": False},
        ("[1,2]", '["a"]'), "[1]"),
    _kw("properties", {"type": "object", "properties": {"a": {"type": "integer"}},
                       "required": ["a"]}, '{"a":"x"}', '{"a":1}'),
    _kw("required", {"type": "object", "properties": {"a": _INT}, "required": ["a"]}, "{}",
        '{"a":1}'),
    _kw("required", {"type": "object", "properties": {"a": _INT}, "required": ["b"]},
        '{"a":1}', id="required-outside-properties"),
    _kw("properties", {"type": "object", "properties": {"a": {}}, "required": ["a"]},
        ('{"a":1', "null", '{"a":[}'), ('{"a":1}', '{"a":{"b":[null]}}'),
        id="properties-of-any-value"),
    _kw("properties", {"type": "object", "properties": {'q"': _INT}, "required": ['q"']},
        '{"q"":1}', '{"q\\"":1}', id="properties-escaped-name"),
    _kw("additionalProperties", {"type": "object", "properties": {"a": _INT},
                                 "additionalProperties": False}, '{"a":1,"b":2}', '{"a":1}'),
    _kw("additionalProperties", {"type": "object", "additionalProperties": {"type": "integer"}},
        '{"a":"x"}', '{"a":1}', id="additionalProperties-schema"),
    _kw("minProperties", {"type": "object", "properties": {"a": _INT}, "minProperties": 1},
        "{}", '{"a":1}'),
    _kw("minProperties", {"type": "object", "additionalProperties": _INT, "minProperties": 1},
        "{}", '{"a":1}', id="minProperties-no-properties"),
    _kw("maxProperties", {"type": "object", "properties": {"a": _INT, "b": _INT},
                          "maxProperties": 1}, '{"a":1,"b":2}', '{"a":1}'),
    _kw("patternProperties", {"type": "object", "patternProperties": {"^a": {"type": "integer"}},
                              "additionalProperties": False}, '{"a":"x"}', '{"a":1}'),
    _kw("propertyNames", {"type": "object", "properties": {"a": _INT, "b": _INT},
                          "propertyNames": {"pattern": "^a"}}, '{"b":1}', '{"a":1}'),
    _kw("dependentRequired", {"type": "object", "properties": {"a": _INT, "b": _INT},
                              "dependentRequired": {"a": ["b"]}}, '{"a":1}', '{"a":1,"b":2}'),
    _kw("dependentSchemas", {"type": "object", "properties": {"a": _INT, "b": _INT},
                             "dependentSchemas": {"a": {"required": ["b"]}}}, '{"a":1}',
        '{"a":1,"b":2}'),
    _kw("anyOf", {"anyOf": [{"type": "integer"}, {"type": "boolean"}]}, '"a"', ("1", "true")),
    _kw("anyOf", {"type": "integer", "anyOf": [{"type": "integer"}, {"type": "string"}]},
        '"a"', "1", id="anyOf-beside-type"),
    _kw("type", {"type": "string", "enum": ["a", 1]}, "1", '"a"', id="type-beside-enum"),
    _kw("maxLength", {"type": "string", "maxLength": 1, "const": "ab"}, '"ab"',
        id="maxLength-beside-const"),
    _kw("const", {"const": {"a.b": 1}}, '{"axb":1}', '{"a.b":1}', id="const-object-key"),
    _kw("oneOf", {"oneOf": [{"type": "integer"}, {"type": "number"}]}, "3", "1.5"),
    _kw("allOf", {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}},
                             "required": ["a"]},
                            {"type": "object", "properties": {"a": {"type": "integer"}}}]},
        ('{"a":"x"}', '{"a":1}{"a":1}'), '{"a":1}'),
    _kw("allOf", {"allOf": [{"type": "integer"}]}, '"a"', "1", id="allOf-one"),
    _kw("$ref", {"$defs": {"i": {"type": "integer"}}, "$ref": "#/$defs/i"}, '"a"', "2"),
    _kw("$ref", {"$defs": {"s": {"type": "string"}}, "$ref": "#/$defs/s", "maxLength": 2},
        '"abc"', '"ab"', id="$ref-beside-maxLength"),
    _kw("$ref", {"$defs": {"n": {"type": "object", "properties": {
        "v": _INT, "c": {"anyOf": [{"$ref": "#/$defs/n"}, {"type": "null"}]}},
        "required": ["v", "c"]}}, "$ref": "#/$defs/n"},
        '{"v":1,"c":{"v":1,"c":{"v":1,"c":{"v":1,"c":{"v":1,"c":{"v":1}}}}}}',
        '{"v":1,"c":{"v":2,"c":null}}', id="$ref-recursive"),
    _kw("not", {"not": {"type": "integer"}}, "4", '"a"'),
    _kw("if", {"if": {"type": "integer"}, "then": {"minimum": 10}}, "4", "12"),
    _kw("contentEncoding", {"type": "string", "contentEncoding": "base64"}, '"!!"', '"YQ=="'),
    _kw("contentMediaType", {"type": "string", "contentMediaType": "application/json"}, '"{"',
        '"1"'),
)


# -- parametrization ------------------------------------------------------------------------------

CHECKS = ("rows", "matchers", "invalid", "jump_forward", "serialize")


def _skip(id: str, reason: str):
    return pytest.param(None, None, id=id, marks=pytest.mark.skip(reason=reason))


def grammar_params(config: pytest.Config, what: str) -> list:
    """pytest.param objects (backend name, item) for `what`: "case" (GrammarCase), "check"
    (one of CHECKS) or "keyword" (KeywordCase)."""
    registry, backends, named = named_plugins(config, "grammar", "conformance_grammar",
                                              "grammar backend")
    params = []
    for name in named or sorted(backends):
        caps = backends[name].caps
        missing = missing_packages(caps.requires)
        if missing:
            if name in named:
                params.append(_skip(f"{name}-unavailable",
                                    f"{name}: package {missing[0]} is not installed"))
            continue
        if what == "check":
            params += [pytest.param(name, check, id=f"{name}-{check}") for check in CHECKS]
        elif what == "keyword":
            if "json_schema" in caps.constraints:
                params += [pytest.param(name, k, id=f"{name}-{k.id}") for k in KEYWORDS]
            elif name in named:
                params.append(_skip(f"{name}-no-json_schema",
                                    f"{name} does not declare json_schema constraints"))
        else:
            for case in CASES:
                kind = case.constraint.kind
                lacking = sorted(case.keywords & caps.schema_lacks)
                if kind in caps.constraints and not lacking:
                    params.append(pytest.param(name, case, id=f"{name}-{case.id}"))
                elif name in named:
                    why = (f"declares {', '.join(lacking)} in schema_lacks" if lacking else
                           f"does not declare {kind} constraints")
                    params.append(_skip(f"{name}-{case.id}-not-covered", f"{name} {why}"))
    return params


_TESTS = {"test_grammar_case_conformance": "case", "test_grammar_protocol_conformance": "check",
          "test_grammar_keyword_conformance": "keyword"}


def parametrize(metafunc: pytest.Metafunc, known: dict[str, str] | None = None) -> None:
    """Parametrize the suite's tests; `known` maps a test id ("xgrammar-oneOf") to the reason it
    is expected to fail (a strict xfail: it fails the run once it passes)."""
    what = _TESTS.get(metafunc.function.__name__)
    if what is None:
        return
    params = grammar_params(metafunc.config, what)
    for i, p in enumerate(params):
        if p.id in (known or {}):
            params[i] = pytest.param(*p.values, id=p.id, marks=[*p.marks, pytest.mark.xfail(
                reason=known[p.id], raises=AssertionError, strict=True)])
    metafunc.parametrize("grammar_backend,grammar_item", params)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    parametrize(metafunc)


# -- the checks (each raises AssertionError on a failure; tests call them) ------------------------

def _sound(v: SuiteVocab, lang: Language, prefix: bytes, token: int) -> bool:
    """Whether `token` keeps `prefix` inside the language."""
    if token in v.stops:
        return lang.state(prefix)[1]
    b = v.bytes_of.get(token)
    return b is not None and lang.state(prefix + b)[0]


def _forced(lang: Language, prefix: bytes, limit: int = 16) -> bytes:
    """The bytes every continuation of `prefix` starts with (b"" where it may end or branch)."""
    out = b""
    while len(out) < limit and not lang.state(prefix + out)[1]:
        nxt = [b for b in range(256) if lang.state(prefix + out + bytes([b]))[0]]
        if len(nxt) != 1:
            break
        out += bytes(nxt)
    return out


def check_mask(v: SuiteVocab, lang: Language, prefix: bytes, got: set[int], what: str) -> None:
    """The mask `got` at `prefix` against the brute-force check over every token."""
    unsound = sorted(t for t in got if not _sound(v, lang, prefix, t))
    assert not unsound, (f"{what}: after {prefix!r} the mask allows {_show(v, unsound)}, which "
                         f"leave the language")
    complete = lang.state(prefix)[1]
    if lang.exact:
        want = {t for t, b in v.bytes_of.items() if lang.state(prefix + b)[0]}
    else:
        want = {t for t, b in v.bytes_of.items()
                if any(w.startswith(prefix + b) for w in lang.words)}
        complete = prefix in lang.words
    if complete:
        want |= set(v.stops)
    missing = sorted(want - got)
    if missing:
        # where the grammar forces the next bytes, one token spelling a start of them will do
        forced = _forced(lang, prefix)
        only = v.bytes_of.get(min(got)) if len(got) == 1 else None
        narrowed = bool(forced and only and forced.startswith(only))
        assert narrowed, (f"{what}: after {prefix!r} the mask lacks {_show(v, missing)}, which "
                          f"keep a valid prefix" + (" (stop tokens: the text is complete)"
                                                    if set(missing) & set(v.stops) else ""))
    assert got or not lang.state(prefix)[0], f"{what}: after {prefix!r} the mask is empty"


def check_jump(v: SuiteVocab, lang: Language, prefix: bytes, m, probe, path: list[int],
               got: set[int], what: str) -> bytes:
    """jump_forward() at `prefix` (m walked `path` to it): sound, and side-effect free; the
    forced bytes it spells."""
    jump = list(m.jump_forward())
    assert allowed(m, v.size) == got, f"{what}: jump_forward() moved the matcher at {prefix!r}"
    odd = [t for t in jump if t not in v.bytes_of]
    assert not odd, f"{what}: jump_forward() at {prefix!r} returned stop/special tokens {odd}"
    text = b"".join(v.bytes_of[t] for t in jump)
    if lang.exact:
        forced = _forced(lang, prefix, limit=len(text))
        assert forced == text, (f"{what}: after {prefix!r} jump_forward() gives {text!r}, but "
                                f"the grammar forces only {forced!r}")
    else:
        assert lang.state(prefix + text)[0], \
            f"{what}: after {prefix!r} jump_forward() gives {text!r}, which leaves the language"
    _replay(probe, path)
    for t in jump:
        assert probe.accept(t), f"{what}: after {prefix!r} the jump's token {t} is refused"
    return text


def _show(v: SuiteVocab, tokens: list[int]) -> str:
    names = [repr(v.bytes_of[t].decode("utf-8", "replace")) if t in v.bytes_of else f"<{t}>"
             for t in tokens[:8]]
    return ", ".join(names) + (f" and {len(tokens) - 8} more" if len(tokens) > 8 else "")


def _replay(matcher, path: list[int]) -> None:
    matcher.reset()
    for t in path:
        assert matcher.accept(t), f"replaying {path}: token {t} refused after reset()"


def check_case(grammar: Grammar, case: GrammarCase) -> None:
    """Walk every word of the case's language (shortest and longest allowed tokens), checking
    the mask, accept, refusals, termination and reset at every prefix."""
    v = suite_vocab()
    lang, c = case.language, case.constraint
    grammar.check(c)  # a valid constraint passes validate
    every = range(v.size)
    for i, word in enumerate(lang.words):
        for longest in (False, True):
            what = f"{case.id} {word!r} ({'longest' if longest else 'shortest'} tokens)"
            m, probe = grammar.matcher(c), grammar.matcher(c)
            first = allowed(m, v.size)
            path: list[int] = []
            prefix = b""
            while True:
                got = allowed(m, v.size)
                check_mask(v, lang, prefix, got, what)
                assert not m.is_terminated(), f"{what}: terminated after {prefix!r}"
                if grammar.caps.jump_forward:
                    check_jump(v, lang, prefix, m, probe, path, got, what)
                for t in every:
                    if t not in got and not _sound(v, lang, prefix, t):
                        assert not m.accept(t), f"{what}: after {prefix!r} accepts token {t}"
                assert allowed(m, v.size) == got, \
                    f"{what}: a refused token changed the state after {prefix!r}"
                sample = sorted(got)[::max(1, len(got) // 6)]
                for t in sample:  # allowed tokens are accepted
                    _replay(probe, path)
                    assert probe.accept(t), f"{what}: after {prefix!r} token {t} is allowed " \
                                            f"by the mask but refused by accept"
                if prefix == word:
                    break
                rest = word[len(prefix):]
                fits = [t for t in got if t in v.bytes_of and rest.startswith(v.bytes_of[t])]
                assert fits, f"{what}: after {prefix!r} the mask allows no token toward {word!r}"
                t = max(fits, key=lambda t: (len(v.bytes_of[t]) * (1 if longest else -1), t))
                assert m.accept(t), f"{what}: accept({t}) refused after {prefix!r}"
                path.append(t)
                prefix += v.bytes_of[t]
            stop = v.stops[i % len(v.stops)]
            assert m.accept(stop), f"{what}: stop token {stop} refused after the whole word"
            assert m.is_terminated(), f"{what}: not terminated after the stop token"
            assert not m.accept(v.stops[0]) and not m.accept(next(iter(v.bytes_of))), \
                f"{what}: a terminated matcher accepted a token"
            m.reset()
            assert not m.is_terminated() and allowed(m, v.size) == first, \
                f"{what}: reset() did not return to the start"
            m.close()
            probe.close()


def check_protocol(grammar: Grammar, check: str) -> None:
    v = suite_vocab()
    kinds = grammar.caps.constraints
    c = next(case.constraint for case in CASES if case.constraint.kind in kinds
             and not case.keywords & grammar.caps.schema_lacks)
    words = -(-v.size // 32)
    if check == "rows":
        m = grammar.matcher(c)
        want = allowed(m, v.size, fill=0)
        assert allowed(m, v.size, fill=-1) == want, \
            "fill_bitmask must write every word of its row (the mask depends on what was there)"
        bitmask = torch.full((3, words), 0x5A5A5A5A, dtype=torch.int32)
        m.fill_bitmask(bitmask, 1)
        assert (bitmask[0] == 0x5A5A5A5A).all() and (bitmask[2] == 0x5A5A5A5A).all(), \
            "fill_bitmask wrote outside its row"
        row = bitmask[1].tolist()
        assert {t for t in range(v.size) if (row[t // 32] >> (t % 32)) & 1} == want
        m.close()
    elif check == "matchers":
        before = grammar.compiled
        a, b, d = grammar.matcher(c), grammar.matcher(c), grammar.matcher(c)
        assert grammar.compiled <= before + 1, "one compile serves every matcher"
        start = allowed(a, v.size)
        t = min(start & set(v.bytes_of))
        assert a.accept(t)
        assert allowed(b, v.size) == start, "accepting in one matcher moved another"
        assert b.accept(t) and allowed(b, v.size) == allowed(a, v.size)
        a.close()
        assert allowed(d, v.size) == start and d.accept(t), "close() of one matcher broke another"
        assert allowed(grammar.matcher(c), v.size) == start, "a new matcher after close()"
        b.close()
        d.close()
    elif check == "invalid":
        tried = 0
        for kind in sorted(kinds):
            for value in INVALID.get(kind, ()):
                bad = Constraint(kind, value, source=f"bad_{kind}")
                for stage in (grammar.backend.validate, grammar.backend.compile):
                    tried += 1
                    with pytest.raises(GrammarError) as e:
                        stage(bad)
                    msg = str(e.value)
                    assert msg.startswith("bad_") and len(msg) > len(f"bad_{kind}: "), \
                        f"{stage.__name__}({kind} {value!r}): the message must name the " \
                        f"request field (Constraint.where) and the problem, got {msg!r}"
        if not tried:
            pytest.skip(f"{grammar.name}: no declared constraint type has invalid values")
    elif check == "jump_forward":
        if not grammar.caps.jump_forward:
            pytest.skip(f"{grammar.name} does not declare jump_forward")
        jumped = b""
        for case in CASES:
            if case.constraint.kind not in kinds or case.keywords & grammar.caps.schema_lacks:
                continue
            m = grammar.matcher(case.constraint)
            for t in _longest_path(v, case.language.words[0], m):
                jumped += b"".join(v.bytes_of[j] for j in m.jump_forward())
                assert m.accept(t)
            m.close()
        assert jumped, (f"{grammar.name} declares jump_forward, but jump_forward() returned no "
                        f"token along the cases' words")
    elif check == "serialize":
        if not grammar.caps.serialize:
            pytest.skip(f"{grammar.name} does not declare serialize (the engine compiles its "
                        f"constraints twice)")
        b = grammar.backend
        for case in CASES:
            if case.constraint.kind not in kinds or case.keywords & grammar.caps.schema_lacks:
                continue
            data = b.serialize(b.compile(case.constraint))
            assert isinstance(data, bytes), f"serialize() must return bytes, got {type(data)}"
            # what the engine's compile process sends back: the same language, token by token
            m, again = b.matcher(b.compile(case.constraint)), b.matcher(b.deserialize(data))
            for t in _longest_path(v, case.language.words[0], m):
                assert allowed(again, v.size) == allowed(m, v.size), \
                    f"{case.id}: the deserialized grammar allows other tokens"
                assert m.accept(t) and again.accept(t)
            assert allowed(again, v.size) == allowed(m, v.size)
            m.close()
            again.close()
    else:
        raise ValueError(check)


def _longest_path(v: SuiteVocab, word: bytes, m) -> list[int]:
    """Tokens spelling `word` (longest allowed first) from m's state; m is not moved."""
    path: list[int] = []
    probe_prefix = b""
    while probe_prefix != word:
        rest = word[len(probe_prefix):]
        got = allowed(m, v.size)
        fits = [t for t in got if t in v.bytes_of and rest.startswith(v.bytes_of[t])]
        assert fits, f"no allowed token toward {word!r} after {probe_prefix!r}"
        t = max(fits, key=lambda t: (len(v.bytes_of[t]), t))
        path.append(t)
        probe_prefix += v.bytes_of[t]
        assert m.accept(t)
    m.reset()
    return path


_BACKEND_COMPILED: dict[tuple[str, str], object] = {}


def _backend_compiled(grammar: Grammar, c: Constraint):
    """backend.compile(c), once per process (the core's checks bypassed)."""
    key = (grammar.name, c.value)
    if key not in _BACKEND_COMPILED:
        _BACKEND_COMPILED[key] = grammar.backend.compile(c)
    return _BACKEND_COMPILED[key]


def text_accepted(grammar: Grammar, c: Constraint, text: str) -> bool:
    """Whether the backend's matcher takes `text` byte by byte and then a stop token (the
    core's checks bypassed: this asks the backend itself)."""
    v = suite_vocab()
    m = grammar.backend.matcher(_backend_compiled(grammar, c))
    try:
        return all(m.accept(b) for b in text.encode()) and m.accept(v.stops[0]) and \
            m.is_terminated()
    finally:
        m.close()


def keyword_status(grammar: Grammar, k: KeywordCase) -> str:
    """How the backend itself treats the keyword: "refused" (GrammarError), "enforced"
    (violations refused), or "loose" (a violation accepted)."""
    c = Constraint("json_schema", json.dumps(k.schema), source="json_schema")
    try:
        grammar.backend.validate(c)
        _backend_compiled(grammar, c)
    except GrammarError:
        return "refused"
    return "loose" if any(text_accepted(grammar, c, t) for t in k.violations) else "enforced"


def check_keyword(grammar: Grammar, k: KeywordCase) -> None:
    name = grammar.name
    if k.keyword in grammar.caps.schema_lacks:
        nested = {"type": "object", "properties": {"p": {"type": "array", "items": k.schema}}}
        for schema in (k.schema, nested):
            with pytest.raises(GrammarError) as e:
                grammar.check(Constraint("json_schema", json.dumps(schema)))
            named = str(e.value).partition(" uses ")[2].partition(", which ")[0].split(", ")
            assert k.keyword in named, f"refused, but not for {k.keyword}: {e.value}"
        return
    c = Constraint("json_schema", json.dumps(k.schema), source="json_schema")
    try:
        grammar.backend.validate(c)
        _backend_compiled(grammar, c)
    except GrammarError:
        return  # refused by the backend itself, with its message: never run loosely
    for t in k.violations:
        assert not text_accepted(grammar, c, t), (
            f"{name} accepts {t} against {k.keyword} in {json.dumps(k.schema)}: enforce it, "
            f"refuse it in validate, or declare it in GrammarCaps.schema_lacks")
    for t in k.satisfying:
        assert text_accepted(grammar, c, t), (
            f"{name} refuses {t}, which satisfies {json.dumps(k.schema)}")


# -- the tests ------------------------------------------------------------------------------------

def test_grammar_case_conformance(grammar_backend, grammar_item):
    """Masks, accept, termination and reset along the words of one constraint's language."""
    check_case(suite_grammar(grammar_backend), grammar_item)


def test_grammar_protocol_conformance(grammar_backend, grammar_item):
    """Bitmask rows, independent matchers and close(), invalid constraints' GrammarError."""
    check_protocol(suite_grammar(grammar_backend), grammar_item)


def test_grammar_keyword_conformance(grammar_backend, grammar_item):
    """A JSON-schema keyword is enforced, refused by the backend, or declared lacking (and then
    refused by the core)."""
    check_keyword(suite_grammar(grammar_backend), grammar_item)

