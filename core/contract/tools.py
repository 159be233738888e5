"""The tool-call parser protocol (tool calling in /v1/chat/completions), as a plugin kind.

A parser registers `register(name, ToolParserCaps, factory)`; the resolver picks one from the
chat template once the tokenizer is loaded (`--tool-call-parser NAME|auto|none`, the plan's
`tool_call_parser`; core.plan.resolver.resolve_tool_parser). The server builds it once:
`parser = factory()`. It turns the model's text into content and calls, and writes the tools
in its format for chat templates that ignore them. It implements ToolParser:

    parse(text, final) -> list[str | ToolCall]
        text is the whole output so far (the parser gets no tools and no tokenizer); the items
        are its pieces in order: text that is content, and calls. It never raises, whatever
        the text. final=True (the finished output): every ToolCall is complete and well formed
        (arguments a JSON object); a call that is not (truncated, arguments not an object)
        stays a str, verbatim, markup included: with no call the pieces join to the text.
        final=False (streaming): the last call may be incomplete, and text at the end that may
        open a call (the start of a marker) is held back (left out). Whatever it returns for a
        text must be a prefix of what it returns for a longer one: content only grows at its
        end, a call's name once set stays, its arguments and raw only grow (a call counts once
        its name is read and its arguments have begun; until then it may still turn out to
        be text). Only a call that turns out malformed breaks this: it becomes text (with the
        calls before it, where the format says so, as llama3's does).
    tools_prompt(tools) -> str       a system message offering `tools` (the request's, in
                                     OpenAI's shape) and saying how to call them in this
                                     format; used when the chat template never reads `tools`
    format_calls(calls) -> str       assistant calls ([{"name", "arguments": dict}]) as the
                                     model writes them (replayed to such a template); parse
                                     reads that text back as those calls, alone or after
                                     content and a newline (how a turn with content replays)
    format_response(content, name) -> str   a tool result as such a template's user turn
                                     holds it: `content` verbatim inside (see below)

ToolCall(name, arguments, raw, complete): name None while not yet read; arguments the JSON text
of the arguments object exactly as the model wrote it (so the streamed fragments join to the
final string), "" until it starts; raw the call's text with its markup; complete: the call's
text has ended. The core (core.server.tools) strips the content, drops calls to functions the
request did not offer back into content (their raw text; the parser reads every call), keeps
the first call only without parallel tool calls, assigns ids (`call_...`) and sends the
OpenAI shapes; streaming it re-parses the growing text and sends what was added. The helpers
below (scan_object, call_at, held_back) are for parsers: JSON objects scanned as they grow,
markers split across tokens.

Nesting: a call whose arguments nest deeper than MAX_ARGUMENT_DEPTH (128) objects and arrays
is not well formed: it stays text, verbatim, like any malformed call (Python's json module, the
core's and most clients', recurses per level and fails near 1,000; 128 is far beyond any real
tool's arguments). While streaming, such a call turns into text as soon as the limit is passed.
The helpers below enforce it (call_at, scan_object); a parser that reads JSON its own way must
too, without recursing per level (`json_depth` measures a text without recursion).

format_response must hold `content` verbatim (unchanged, as one substring: no escaping,
trimming or re-encoding): the tool's result is the model's only view of it.

ToolParserCaps.parallel_calls says whether the format holds several calls in one answer. The
conformance suite (conformance/tool_parser_suite.py; `pytest --conformance-tool-parser NAME
-rs`) checks all of the above on a parser, writing its texts with the parser's format_calls.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from core.contract.json_types import JSONObject

if TYPE_CHECKING:
    from core.plan.registry import Registry

TOOL_PARSER_OFF = "none"
MAX_ARGUMENT_DEPTH = 128  # objects and arrays nested in a call's arguments (module docstring)
_WS = " \t\n\r"


@dataclass(frozen=True)
class ToolCall:
    """One call as parsed (see the module docstring)."""

    name: str | None
    arguments: str = ""
    raw: str = ""
    complete: bool = True


Piece = str | ToolCall


@runtime_checkable
class ToolParser(Protocol):
    def parse(self, text: str, final: bool) -> list[Piece]: ...

    def tools_prompt(self, tools: Sequence[JSONObject]) -> str: ...

    def format_calls(self, calls: Sequence[JSONObject]) -> str: ...

    def format_response(self, content: str, name: str | None) -> str: ...


# -- helpers for parsers ---------------------------------------------------------------------------

def held_back(text: str, marker: str) -> int:
    """How many characters at the end of `text` may be the start of `marker` (to hold back
    while streaming: `<tool_c` may become `<tool_call>`)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


def skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


def _string_end(text: str, i: int) -> int | None:
    j = i + 1
    while j < len(text):
        if text[j] == "\\":
            j += 2
            continue
        if text[j] == '"':
            return j + 1
        j += 1
    return None


_BARE = frozenset("{}[],:-+.0123456789eEtrufalsn" + _WS)  # what JSON has outside strings


def value_end(text: str, i: int, max_depth: int | None = None) -> int | None:
    """Index just past the JSON value starting at text[i] (not a space); None when the text
    ends inside it; ValueError when brackets do not match or a character cannot be JSON there
    (so a malformed call is known as early as possible), or when it nests more than
    `max_depth` objects and arrays (None: any depth; it never recurses). Tokens are not
    checked further (json.loads does that once the value is complete)."""
    c = text[i]
    if c == '"':
        return _string_end(text, i)
    if c in "{[":
        stack: list[str] = []
        j = i
        while j < len(text):
            ch = text[j]
            if ch == '"':
                end = _string_end(text, j)
                if end is None:
                    return None
                j = end
                continue
            if ch not in _BARE:
                raise ValueError(f"unexpected {ch!r} at {j}")
            if ch in "{[":
                stack.append("}" if ch == "{" else "]")
                if max_depth is not None and len(stack) > max_depth:
                    raise ValueError(f"nested deeper than {max_depth} levels at {j}")
            elif ch in "}]":
                if not stack or stack.pop() != ch:
                    raise ValueError(f"unexpected {ch!r} at {j}")
                if not stack:
                    return j + 1
            j += 1
        return None
    if c in ",:}]":
        raise ValueError(f"unexpected {c!r} at {i}")
    j = i
    while j < len(text) and text[j] not in ",}]" + _WS:
        if text[j] not in _BARE:
            raise ValueError(f"unexpected {text[j]!r} at {j}")
        j += 1
    return j if j < len(text) else None  # a number may go on


def scan_object(text: str, i: int, max_depth: int | None = None
                ) -> tuple[dict[str, tuple[int | None, int | None]], int | None]:
    """The top-level keys of the JSON object starting at text[i] == "{" as far as the text goes:
    key -> (start, end) of its value (start None: not begun; end None: not ended), and the index
    just past the object (None while open). ValueError when it cannot be an object, or nests
    more than `max_depth` levels (the object itself is one; None: any depth)."""
    inner = None if max_depth is None else max_depth - 1
    fields: dict[str, tuple[int | None, int | None]] = {}
    j = skip_ws(text, i + 1)
    if j < len(text) and text[j] == "}":
        return fields, j + 1
    while j < len(text):
        if text[j] != '"':
            raise ValueError(f"expected a key at {j}")
        end = _string_end(text, j)
        if end is None:
            return fields, None
        key = json.loads(text[j:end])
        j = skip_ws(text, end)
        if j == len(text):
            return fields, None
        if text[j] != ":":
            raise ValueError(f"expected ':' at {j}")
        j = skip_ws(text, j + 1)
        if j == len(text):
            fields[key] = (None, None)
            return fields, None
        vend = value_end(text, j, inner)
        fields[key] = (j, vend)
        if vend is None:
            return fields, None
        j = skip_ws(text, vend)
        if j == len(text):
            return fields, None
        if text[j] == "}":
            return fields, j + 1
        if text[j] != ",":
            raise ValueError(f"expected ',' or '}}' at {j}")
        j = skip_ws(text, j + 1)
    return fields, None


def call_at(text: str, i: int, final: bool, keys: Sequence[str] = ("arguments", "parameters")
            ) -> tuple[ToolCall, int | None] | None:
    """The call written as a JSON object {"name": str, <key>: {...}} at text[i] == "{" (keys:
    where the arguments may be, first found wins), and the index past it (None while open).
    None when it is not a well-formed call (final=True: also when it is unfinished), arguments
    nested deeper than MAX_ARGUMENT_DEPTH included (as soon as the text passes the limit)."""
    try:
        fields, end = scan_object(text, i, MAX_ARGUMENT_DEPTH + 1)
    except ValueError:
        return None
    name = None
    ns, ne = fields.get("name", (None, None))
    if ns is not None and ne is not None:
        name = json.loads(text[ns:ne]) if text[ns] == '"' else None
        if not isinstance(name, str) or not name:
            return None
    key = next((k for k in keys if k in fields), None)
    args = ""
    if key is not None:
        s, e = fields[key]
        if s is not None:
            if text[s] != "{":
                return None  # the arguments must be an object
            args = text[s:e] if e is not None else text[s:]
    raw = text[i:end] if end is not None else text[i:]
    if end is None:
        return None if final else (ToolCall(name, args, raw, False), None)
    if name is None or any(k not in ("name", *keys) for k in fields):
        return None
    try:
        whole = json.loads(raw)
        parsed = json.loads(args) if args else {}
    except (ValueError, RecursionError):  # the depth is bounded above; this is a backstop
        return None
    if not isinstance(whole, dict) or not isinstance(parsed, dict):
        return None
    return ToolCall(name, args or "{}", raw, True), end


def json_depth(text: str) -> int:
    """How deep objects and arrays nest in a JSON text (brackets inside strings do not count),
    without recursion: 0 for a scalar."""
    depth = deepest = 0
    j = 0
    while j < len(text):
        ch = text[j]
        if ch == '"':
            end = _string_end(text, j)
            if end is None:
                break
            j = end
            continue
        if ch in "{[":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "}]":
            depth -= 1
        j += 1
    return deepest


# -- chat templates ------------------------------------------------------------------------------

def template_reads_tools(template: str | None) -> bool:
    """Whether a Jinja chat template ever reads the variable `tools` (the rule that decides
    whether tools go to the template or into a system message; None: no template known)."""
    if not template:
        return False
    try:
        import jinja2
        from jinja2 import meta

        env = jinja2.Environment(extensions=["jinja2.ext.loopcontrols", "jinja2.ext.do"])
        return "tools" in meta.find_undeclared_variables(env.parse(template))
    except Exception:  # a template using tags plain Jinja lacks: read its text instead
        return re.search(r"\btools\b", template) is not None


def make_tool_parser(registry: Registry, name: str | None) -> ToolParser | None:
    """Build the plan's tool-call parser; None when off."""
    if name is None:
        return None
    reg = registry.get("tool_parser", name)
    if reg is None:
        raise ValueError(f"tool-call parser {name!r} is not registered in this process")
    return reg.load()()
