"""Tool calling in /v1/chat/completions: the request fields, the prompt, the parsed answer.

Fields (OpenAI's, as SGLang and vLLM take them):

    tools                [{"type": "function", "function": {"name", "description", "parameters"
                          (a JSON schema of an object; absent: no arguments), "strict"}}]
    tool_choice          "none" | "auto" (the default with tools) | "required" |
                         {"type": "function", "function": {"name": ...}}
    parallel_tool_calls  true (default) | false: at most one call

What each choice does:
- auto: the model answers freely; the server's tool-call parser (core.contract.tools, the plan's
  tool_call_parser) reads calls out of the text: message.tool_calls, finish_reason
  "tool_calls", content what is left (null when nothing). Needs a parser (400 with
  --tool-call-parser none). `strict: true` is refused here: nothing enforces the schema.
- required / named: the grammar constrains the answer (a json_schema constraint, so a grammar
  backend is needed): named, the function's arguments object; required, a JSON array of
  {"name": <one of the tools>, <key>: <its arguments>} with at least one item (one with
  parallel_tool_calls false), <key> being the parser's arguments_key ("parameters" without
  one); a tool whose schema refers into itself ($ref "#/$defs/X", "#/definitions/X", "#")
  sits in the array schema's $defs under its name, its references re-pointed there, so that
  two tools' definitions of one name do not collide. The answer is read directly: it is
  always a valid call.
- none: no call is parsed or constrained; the chat template still gets the tools (vLLM's
  default; it has --exclude-tools-when-tool-choice-none).
A structured-output field (response_format, guided_json, ...) together with tools and a
choice other than none is a 400: required and named take the one constraint a request has,
and under auto the constraint would keep the model from writing a call (vLLM refuses structured
outputs with a named tool too).

The prompt. The tools go to the chat template as `tools=` (apply_chat_template's, as HF does),
assistant messages' tool_calls with their arguments as objects and tool messages as
{"role": "tool", "content", "tool_call_id", "name"}. A template that never reads `tools`
(core.contract.tools.template_reads_tools; SmolLM2's) gets them another way, always the same: the
parser's tools_prompt is added to the first system message (after a blank line) or becomes one
at the start; assistant tool calls are appended to the message's content in the parser's
format (format_calls, after a newline when there is content); each tool message becomes a user
turn holding format_response(content) (consecutive ones joined by newlines in one turn).

Streaming: every event re-parses the text so far and sends what is new: content deltas
(trailing spaces and text that may open a call held back, so no markup leaks), a call's first
delta with index, id, type, function.name and arguments "" once its name is read and its
arguments object has begun, then argument fragments (the arguments exactly as written: joined
they equal the non-streamed string). Under auto a call can turn out malformed after its header
went out (`{"city": "Paris"` then text); what was streamed cannot be taken back, and the rest
of its text follows as content, as the non-streamed answer has it. Constrained calls (required,
named) are always well formed.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Protocol, TypedDict

from core.contract.tools import (
    MAX_ARGUMENT_DEPTH,
    Piece,
    ToolCall,
    ToolParser,
    call_at,
    json_depth,
    skip_ws,
    template_reads_tools,
    value_end,
)
from core.server.errors import invalid

if TYPE_CHECKING:
    from core.contract.json_types import JSON, JSONObject
    from core.plan.registry import Registry
    from core.server.engine_api import EngineLike
    from core.server.protocol import ChatMessage, ParsedRequest

MAX_TOOLS = 128  # OpenAI's limit
NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
TOOL_KEYS = ("type", "function")
FUNCTION_KEYS = ("name", "description", "parameters", "strict")
CHOICES = ("none", "auto", "required")
CALL_KEYS = ("id", "type", "function")
NO_ARGUMENTS: JSONObject = {"type": "object", "properties": {}, "additionalProperties": False}


class _FunctionSpecBase(TypedDict):
    name: str


class FunctionSpec(_FunctionSpecBase, total=False):
    """A checked tool's function: the fields given (not null) of FUNCTION_KEYS."""

    description: str
    parameters: JSONObject  # the JSON schema of the arguments object
    strict: bool


class ToolSpec(TypedDict):
    """One checked entry of `tools`."""

    type: Literal["function"]
    function: FunctionSpec


class CalledFunction(TypedDict):
    name: str
    arguments: JSONObject  # parsed from the client's JSON text, as templates render it


class MessageToolCall(TypedDict):
    """A call of a request's assistant message, in HF's shape (`_message_call`)."""

    id: str
    type: Literal["function"]
    function: CalledFunction


class MessageToolFields(TypedDict, total=False):
    """What `message_fields` adds to a checked message."""

    tool_calls: list[MessageToolCall]  # assistant messages
    tool_call_id: str  # tool messages


class ResponseFunction(TypedDict):
    name: str
    arguments: str  # the arguments' JSON text as the model wrote it


class ResponseToolCall(TypedDict):
    id: str
    type: Literal["function"]
    function: ResponseFunction


class _AssistantMessageBase(TypedDict):
    role: Literal["assistant"]
    content: str | None


class AssistantMessage(_AssistantMessageBase, total=False):
    """The non-streamed message of a choice read for tool calls (`final_message`)."""

    tool_calls: list[ResponseToolCall]


class FunctionDelta(TypedDict, total=False):
    name: str  # in a call's first delta only
    arguments: str


class _ToolCallDeltaBase(TypedDict):
    index: int
    function: FunctionDelta


class ToolCallDelta(_ToolCallDeltaBase, total=False):
    id: str  # in a call's first delta only
    type: Literal["function"]


class MessageDelta(TypedDict, total=False):
    """One streamed delta of `ToolStream.step`: new content or one call's header / fragment."""

    content: str
    tool_calls: list[ToolCallDelta]


class CallReader(Protocol):
    """What reads an answer for tool calls: the server's ToolParser, NamedCall or CallArray."""

    def parse(self, text: str, final: bool) -> list[Piece]: ...


@dataclass(frozen=True)
class ToolRequest:
    """A chat request's tool fields, checked. choice: none | auto | required | named."""

    tools: tuple[ToolSpec, ...]
    choice: str
    name: str | None = None  # the named function
    parallel: bool = True

    @property
    def names(self) -> list[str]:
        return [t["function"]["name"] for t in self.tools]

    def parameters(self, i: int) -> JSONObject:
        p = self.tools[i]["function"].get("parameters")
        if not p:
            return dict(NO_ARGUMENTS)
        return p if "type" in p else {"type": "object", **p}


def _type(v: JSON) -> str:
    return {type(None): "null", bool: "boolean", str: "string", list: "array",
            dict: "object"}.get(type(v), "number")


def _keys(d: JSONObject, allowed: Sequence[str], where: str) -> None:
    for key in d:
        if key not in allowed:
            raise invalid(f"{where}.{key}", f"unknown parameter {where}.{str(key)[:40]}: it takes "
                          f"{', '.join(allowed)}", code="unknown_parameter")


def _tool(t: JSON, i: int) -> ToolSpec:
    where = f"tools[{i}]"
    if not isinstance(t, dict):
        raise invalid(where, f"{where} must be an object", code="invalid_type")
    _keys(t, TOOL_KEYS, where)
    if t.get("type") != "function":
        raise invalid(f"{where}.type", f"{where}.type must be \"function\" (the only tool type "
                      f"served), got {json.dumps(t.get('type'))[:40]}")
    f = t.get("function")
    if not isinstance(f, dict):
        raise invalid(f"{where}.function", f"{where}.function must be an object with a name",
                      code="missing_required_parameter" if f is None else "invalid_type")
    _keys(f, FUNCTION_KEYS, f"{where}.function")
    name = f.get("name")
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise invalid(f"{where}.function.name", f"{where}.function.name must be 1-64 letters, "
                      f"digits, '_', '.' or '-', got {json.dumps(name)[:40]}")
    for key, want, what in (("description", str, "a string"), ("strict", bool, "a boolean"),
                            ("parameters", dict, "a JSON schema object")):
        if f.get(key) is not None and not isinstance(f[key], want):
            raise invalid(f"{where}.function.{key}", f"{where}.function.{key} must be {what}, "
                          f"got {_type(f[key])}", code="invalid_type")
    params = f.get("parameters")
    if params and params.get("type", "object") != "object":
        raise invalid(f"{where}.function.parameters", f"{where}.function.parameters must be "
                      "the JSON schema of an object (type \"object\"): arguments are an object")
    return {"type": "function", "function": {k: f[k] for k in FUNCTION_KEYS
                                             if f.get(k) is not None}}


def parse_tools(body: JSONObject) -> ToolRequest | None:
    """The tool fields of a chat body; None when there are no tools (then tool_choice may only
    be none / auto, which ask for nothing). 400 naming the field otherwise."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    ptc = body.get("parallel_tool_calls")
    if ptc is not None and not isinstance(ptc, bool):
        raise invalid("parallel_tool_calls", "parallel_tool_calls must be true or false",
                      code="invalid_type")
    if tools is not None and not isinstance(tools, list):
        raise invalid("tools", "tools must be an array of tools", code="invalid_type")
    if len(tools or ()) > MAX_TOOLS:
        raise invalid("tools", f"tools has {len(tools)} entries; at most {MAX_TOOLS}")
    if isinstance(choice, dict):
        _keys(choice, TOOL_KEYS, "tool_choice")
        fn = choice.get("function")
        if choice.get("type") != "function" or not isinstance(fn, dict) \
                or not isinstance(fn.get("name"), str):
            raise invalid("tool_choice", "tool_choice must be \"none\", \"auto\", \"required\" "
                          "or {\"type\": \"function\", \"function\": {\"name\": ...}}")
        _keys(fn, ("name",), "tool_choice.function")
    elif choice is not None and choice not in CHOICES:
        raise invalid("tool_choice", "tool_choice must be \"none\", \"auto\", \"required\" or "
                      "{\"type\": \"function\", \"function\": {\"name\": ...}}, got "
                      f"{json.dumps(choice)[:40]}", code="invalid_type"
                      if not isinstance(choice, str) else "invalid_value")
    if not tools:
        if choice not in (None, "none", "auto"):
            raise invalid("tool_choice", "tool_choice " + (choice if isinstance(choice, str)
                          else "naming a function") + " needs tools: give the functions in "
                          "tools", code="missing_required_parameter")
        return None
    checked = tuple(_tool(t, i) for i, t in enumerate(tools))
    seen: dict[str, int] = {}
    for i, t in enumerate(checked):
        name = t["function"]["name"]
        if name in seen:
            raise invalid(f"tools[{i}].function.name", f"tools[{i}].function.name {name!r} is "
                          f"also tools[{seen[name]}]'s: function names must be unique")
        seen[name] = i
    name = None
    if isinstance(choice, dict):
        name = choice["function"]["name"]
        if name not in seen:
            raise invalid("tool_choice.function.name", f"tool_choice names function "
                          f"{json.dumps(name)[:70]}, which is not in tools "
                          f"({', '.join(seen)})"[:300])
        choice = "named"
    choice = choice or "auto"
    if choice == "auto":
        for i, t in enumerate(checked):
            if t["function"].get("strict"):
                raise invalid(f"tools[{i}].function.strict", f"tools[{i}].function.strict: "
                              "strict schemas are enforced only when the call is constrained "
                              "(tool_choice \"required\" or a named function); with \"auto\" "
                              "calls are parsed from free text, so strict would not hold",
                              code="unsupported")
    return ToolRequest(checked, choice, name, True if ptc is None else ptc)


def check_with_constraint(treq: ToolRequest | None, constraint: dict[str, str] | None) -> None:
    """A structured-output constraint and tool calls do not go together (module docstring)."""
    if treq is None or constraint is None or treq.choice == "none":
        return
    what = ("takes the request's one grammar constraint" if treq.choice != "auto" else
            "parses calls from free text, which the constraint would keep the model from "
            "writing")
    raise invalid(constraint["source"], f"{constraint['source']} cannot be combined with tools "
                  f"and tool_choice {treq.name or treq.choice!r}: tool calling {what}; send "
                  "tool_choice \"none\" or leave the structured-output field out",
                  code="unsupported")


def tool_constraint(treq: ToolRequest, key: str) -> dict[str, str] | None:
    """The json_schema constraint of tool_choice required / named (None otherwise)."""
    if treq.choice == "named":
        i = treq.names.index(treq.name)
        return {"kind": "json_schema", "value": json.dumps(treq.parameters(i)),
                "source": f"tools[{i}].function.parameters"}
    if treq.choice != "required":
        return None
    items: list[JSON] = []
    defs: JSONObject = {}
    for i, n in enumerate(treq.names):
        params = treq.parameters(i)
        base = f"#/$defs/{n}"  # a tool name needs no JSON-pointer escape (NAME)
        moved = _rebased(params, base)
        if moved is not None:  # its $refs point into it: it sits in $defs, under its name
            defs[n] = moved
            params = {"$ref": base}
        items.append({"type": "object", "properties": {"name": {"enum": [n]}, key: params},
                      "required": ["name", key], "additionalProperties": False})
    schema: JSONObject = {"type": "array", "minItems": 1,
                          "items": items[0] if len(items) == 1 else {"anyOf": items}}
    if not treq.parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return {"kind": "json_schema", "value": json.dumps(schema), "source": "tools"}


# keywords whose values are JSON data, not schemas (a "$ref" key in them is no reference)
_DATA_KEYWORDS = frozenset({"enum", "const", "default", "examples"})
# keywords whose values map names to schemas (a name may be any keyword's)
_SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions",
                          "dependentSchemas"})


def _rebased(params: JSONObject, base: str) -> JSONObject | None:
    """A tool's parameters schema moved to the JSON pointer `base` of the required array's
    schema: a copy whose local references ("#", "#/$defs/X", "#/definitions/X", any "#/..."
    pointer into the tool's schema) point under `base`, so that each tool's definitions stay
    its own (two tools may both define a DataType). None when it has no local reference: it
    can stay inline as it is. Walked without recursion (a body may nest as deep as the JSON
    parser goes)."""
    copy = json.loads(json.dumps(params))
    copy.pop("$id", None)  # it would make "#" mean the tool's schema again, not the root
    copy.pop("$schema", None)  # (only a root may name its dialect)
    found = False
    todo: list[JSON] = [copy]
    while todo:
        s = todo.pop()
        if isinstance(s, list):
            todo.extend(s)
            continue
        if not isinstance(s, dict):
            continue
        for k, v in s.items():
            if k == "$ref":
                if isinstance(v, str) and (v == "#" or v.startswith("#/")):
                    s[k] = base + v[1:]
                    found = True
            elif k in _SCHEMA_MAPS and isinstance(v, dict):
                todo.extend(v.values())
            elif k not in _DATA_KEYWORDS:
                todo.append(v)
    return copy if found else None


# -- messages --------------------------------------------------------------------------------

def message_fields(m: JSONObject, where: str, role: str) -> MessageToolFields:
    """tool_calls (assistant) and tool_call_id (tool) of one message, in HF's shape: a call's
    arguments parsed into an object, as chat templates render them (`| tojson`)."""
    out: MessageToolFields = {}
    calls, cid = m.get("tool_calls"), m.get("tool_call_id")
    if calls:  # null / [] are what SDKs write back for a reply without calls
        if role != "assistant":
            raise invalid(f"{where}.tool_calls", f"{where}.tool_calls: only assistant messages "
                          "carry tool calls")
        if not isinstance(calls, list):
            raise invalid(f"{where}.tool_calls", f"{where}.tool_calls must be an array",
                          code="invalid_type")
        out["tool_calls"] = [_message_call(c, f"{where}.tool_calls[{j}]")
                             for j, c in enumerate(calls)]
    if role == "tool":
        if not isinstance(cid, str) or not cid:
            raise invalid(f"{where}.tool_call_id", f"{where}.tool_call_id is required: the id "
                          "of the call this message answers", code="missing_required_parameter"
                          if cid is None else "invalid_type")
        out["tool_call_id"] = cid
    elif cid is not None:
        raise invalid(f"{where}.tool_call_id", f"{where}.tool_call_id: only tool messages "
                      "answer a call")
    return out


def _message_call(c: JSON, where: str) -> MessageToolCall:
    if not isinstance(c, dict):
        raise invalid(where, f"{where} must be an object", code="invalid_type")
    _keys(c, CALL_KEYS, where)
    if not isinstance(c.get("id"), str):
        raise invalid(f"{where}.id", f"{where}.id must be a string",
                      code="missing_required_parameter" if c.get("id") is None
                      else "invalid_type")
    if c.get("type", "function") != "function":
        raise invalid(f"{where}.type", f"{where}.type must be \"function\"")
    f = c.get("function")
    if not isinstance(f, dict):
        raise invalid(f"{where}.function", f"{where}.function must be an object with name and "
                      "arguments", code="invalid_type")
    _keys(f, ("name", "arguments"), f"{where}.function")
    if not isinstance(f.get("name"), str) or not f["name"]:
        raise invalid(f"{where}.function.name", f"{where}.function.name must be a string",
                      code="invalid_type")
    args = f.get("arguments")
    if isinstance(args, str) and json_depth(args) > MAX_ARGUMENT_DEPTH:
        raise invalid(f"{where}.function.arguments", f"{where}.function.arguments nest deeper "
                      f"than {MAX_ARGUMENT_DEPTH} levels")
    try:
        parsed = json.loads(args) if isinstance(args, str) else None
    except ValueError:
        parsed = None
    if not isinstance(parsed, dict):
        raise invalid(f"{where}.function.arguments", f"{where}.function.arguments must be the "
                      "JSON text of an object", code="invalid_type")
    return {"id": c["id"], "type": "function",
            "function": {"name": f["name"], "arguments": parsed}}


def name_tool_results(messages: list[ChatMessage]) -> None:
    """Give each tool message the name of the call it answers (templates may print it)."""
    names = {c["id"]: c["function"]["name"] for m in messages for c in m.get("tool_calls", ())}
    for m in messages:
        if m["role"] == "tool" and "name" not in m and m["tool_call_id"] in names:
            m["name"] = names[m["tool_call_id"]]


def texts_of(messages: list[ChatMessage], treq: ToolRequest | None) -> list[tuple[str, str]]:
    """(field, text) the template renders besides message content: call names and arguments,
    tool definitions (special-token text in them is refused like in content)."""
    out = []
    for i, m in enumerate(messages):
        for j, c in enumerate(m.get("tool_calls", ())):
            out.append((f"messages[{i}].tool_calls[{j}].function",
                        c["function"]["name"] + json.dumps(c["function"]["arguments"],
                                                           ensure_ascii=False)))
    for i, t in enumerate(treq.tools if treq else ()):
        out.append((f"tools[{i}]", json.dumps(t, ensure_ascii=False)))
    return out


class ServerTools:
    """The server's tool calling: the plan's parser (None: auto off) and how the template
    takes tools."""

    def __init__(self, parser_name: str | None, chat_template: str | None,
                 registry: Registry | None = None, special_tokens: tuple[str, ...] = ()):
        self.parser_name = parser_name
        self.parser: ToolParser | None = None
        self.arguments_key = "parameters"  # vLLM's key, when no parser says otherwise
        self.keep_special = False  # the parser reads special tokens' texts (harmony's)
        if parser_name is not None:
            if registry is None:
                from core.plan.registry import get_registry

                registry = get_registry()
            reg = registry.get("tool_parser", parser_name)
            if reg is None:
                raise ValueError(f"tool-call parser {parser_name!r} is not registered")
            self.parser = reg.load()()
            self.arguments_key = reg.caps.arguments_key
            self.keep_special = any(m in special_tokens for m in reg.caps.reads)
        self.template_reads_tools = template_reads_tools(chat_template)

    @classmethod
    def of_engine(cls, engine: EngineLike) -> ServerTools:
        plan = engine.plan_dict() or {}
        tok = engine.tokenizer
        return cls(plan.get("tool_call_parser"), tok.chat_template,
                   special_tokens=tuple(tok.special_tokens))

    def prepare(self, req: ParsedRequest) -> None:
        """Server-dependent checks, and the constraint of required / named (before the
        engine validates the sampling parameters)."""
        treq = req.tools
        msgs = [m for p in req.prompts for m in p.messages or ()]
        replayed = any(m["role"] == "tool" or m.get("tool_calls") for m in msgs)
        if self.parser is None and not self.template_reads_tools and (treq or replayed):
            raise invalid("tools" if treq else "messages", "this chat template never reads "
                          "tools and the server runs with --tool-call-parser none, so nothing "
                          "could show the model its tools or tool calls; start the server with "
                          "a tool-call parser (or a chat template that renders tools)",
                          code="unsupported")
        if treq is None:
            return
        if treq.choice == "auto" and self.parser is None:
            raise invalid("tool_choice", "tool_choice \"auto\" needs a tool-call parser and this "
                          "server runs with --tool-call-parser none; use \"required\" or a named "
                          "function (constrained by the grammar), or \"none\"",
                          code="unsupported")
        if treq.choice == "auto" and self.keep_special:  # its calls are written in them
            if req.sampling.get("skip_special_tokens") is True:
                raise invalid("skip_special_tokens", "skip_special_tokens: the tool-call parser "
                              f"{self.parser_name} reads calls written in special tokens, which "
                              "skipping would remove; leave it out, or send tool_choice "
                              "\"none\"", code="unsupported")
            req.sampling["skip_special_tokens"] = False
        c = tool_constraint(treq, self.arguments_key)
        if c is not None:
            req.sampling["constraint"] = c

    def render(self, messages: list[ChatMessage], treq: ToolRequest | None
               ) -> tuple[list[ChatMessage], list[ToolSpec] | None]:
        """(messages, tools) for the chat template (module docstring)."""
        tools = [dict(t) for t in treq.tools] if treq else None
        if self.template_reads_tools or self.parser is None:
            return messages, tools
        p = self.parser
        out: list[ChatMessage] = []
        merge = False
        for m in messages:
            if m["role"] == "tool":
                text = p.format_response(m["content"], m.get("name"))
                if merge:
                    out[-1] = {**out[-1], "content": out[-1]["content"] + "\n" + text}
                else:
                    out.append({"role": "user", "content": text})
                merge = True
                continue
            merge = False
            if m.get("tool_calls"):
                calls = p.format_calls([c["function"] for c in m["tool_calls"]])
                content = m["content"] + "\n" + calls if m["content"] else calls
                m = {"role": m["role"], "content": content}
            out.append(m)
        if tools:
            prompt = p.tools_prompt(tools)
            if out and out[0]["role"] == "system":
                out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + prompt}
            else:
                out.insert(0, {"role": "system", "content": prompt})
        return out, None

    def output_parser(self, treq: ToolRequest | None) -> CallReader | None:
        """What reads a request's answer: the server's parser (auto), the constrained shapes
        (required / named), or nothing (no tools, none)."""
        if treq is None or treq.choice == "none":
            return None
        if treq.choice == "named":
            return NamedCall(treq.name or "")
        if treq.choice == "required":
            return CallArray(self.arguments_key)
        return self.parser


# -- reading the answer -------------------------------------------------------------------------

class NamedCall:
    """The answer of a named tool_choice: the arguments object itself."""

    def __init__(self, name: str):
        self.name = name

    def parse(self, text: str, final: bool) -> list[Piece]:
        j = skip_ws(text, 0)
        end = value_end(text, j) if j < len(text) else None
        args = text[j:end] if end is not None else text[j:]
        return [ToolCall(self.name, args, text, end is not None)]


class CallArray:
    """The answer of tool_choice required: [{"name": ..., <key>: {...}}, ...]."""

    def __init__(self, key: str):
        self.key = key

    def parse(self, text: str, final: bool) -> list[Piece]:
        out: list[Piece] = []
        j = skip_ws(text, 0)
        if j == len(text) or text[j] != "[":
            return out
        j = skip_ws(text, j + 1)
        while j < len(text) and text[j] == "{":
            got = call_at(text, j, False, (self.key,))
            if got is None:
                break
            call, end = got
            out.append(call)
            if end is None:
                break
            j = skip_ws(text, end)
            if j < len(text) and text[j] == ",":
                j = skip_ws(text, j + 1)
        return out


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _settle(pieces: list[Piece], names: set[str], parallel: bool
            ) -> tuple[str, list[ToolCall]]:
    """Content (stripped) and the calls to send: calls to functions not offered go back into
    the content as written; without parallel calls only the first is kept; content stops at a
    call whose name is not read yet (what follows it is not known to be content)."""
    parts: list[str] = []
    calls: list[ToolCall] = []
    for p in pieces:
        if isinstance(p, str):
            parts.append(p)
        elif p.name is None:
            break
        elif p.name not in names:
            parts.append(p.raw)
        elif parallel or not calls:
            calls.append(p)
    return "".join(parts).strip(), calls


def final_message(parser: CallReader, treq: ToolRequest, text: str, finish: str | None
                  ) -> tuple[AssistantMessage, str | None]:
    """The non-streamed message of one choice and its finish_reason."""
    content, calls = _settle(parser.parse(text, True), set(treq.names), treq.parallel)
    msg: AssistantMessage = {"role": "assistant", "content": content or None}
    if calls:
        msg["tool_calls"] = [{"id": _call_id(), "type": "function",
                              "function": {"name": c.name, "arguments": c.arguments}}
                             for c in calls]
        if finish == "stop":
            finish = "tool_calls"
    return msg, finish


class ToolStream:
    """One streamed choice: each step re-parses the text so far and returns the new deltas."""

    def __init__(self, parser: CallReader, treq: ToolRequest):
        self.parser, self.names, self.parallel = parser, set(treq.names), treq.parallel
        self.content = ""
        self.sent: list[tuple[str, str]] = []  # per call sent: (name, arguments sent)

    @property
    def called(self) -> bool:
        return bool(self.sent)

    def step(self, text: str, final: bool) -> list[MessageDelta]:
        content, calls = _settle(self.parser.parse(text, final), self.names, self.parallel)
        deltas: list[MessageDelta] = []
        if len(content) > len(self.content) and content.startswith(self.content):
            deltas.append({"content": content[len(self.content):]})
            self.content = content
        for k, c in enumerate(calls):
            if k == len(self.sent) and not (c.arguments or c.complete):
                break  # the header waits for the arguments to begin (a bad value shows first)
            if k == len(self.sent):
                deltas.append({"tool_calls": [{"index": k, "id": _call_id(), "type": "function",
                                               "function": {"name": c.name, "arguments": ""}}]})
                self.sent.append((c.name or "", ""))
            name, args = self.sent[k]
            if c.name == name and len(c.arguments) > len(args) \
                    and c.arguments.startswith(args):
                deltas.append({"tool_calls": [{"index": k, "function": {
                    "arguments": c.arguments[len(args):]}}]})
                self.sent[k] = (name, c.arguments)
        return deltas
