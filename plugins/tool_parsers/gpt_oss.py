"""`gpt-oss` tool-call parser: function calls inside OpenAI's harmony format, as gpt-oss writes
them (SGLang: `gpt-oss`; vLLM: `openai`):

    <|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>
    <|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>

A message is a header (`<|start|>` and a role, and/or `<|channel|>` and a channel name, the
recipient `to=...` in either part, maybe a content type, `<|constrain|>json` or a bare `json`)
up to `<|message|>`, then its body. A call is a message on the `commentary` channel addressed
to `functions.NAME` (from the assistant, where the header names a role) whose body is a JSON
object: the arguments, exactly as written. The body ends at `<|call|>` (or `<|end|>` /
`<|return|>`, or the next header), or at the end of the text: `<|call|>` is one of gpt-oss's stop
tokens, so the text usually ends right after the object. Everything else is content, verbatim,
markup included: other channels' messages (analysis, final, preambles on commentary), calls to
other recipients (the built-in `browser.*` / `python` tools), and a call whose body is not an
object or is cut off. Its raw text runs from its header's first marker through its end marker.

This agrees with the `gpt-oss` reasoning parser (plugins/reasoning_parsers/gpt_oss.py) on the
channels: analysis is reasoning, final is content, commentary to=functions.NAME is a call.
With both on (as gpt-oss is served), the reasoning parser takes the analysis and final bodies
and hands the commentary messages, markup included, to the content, where this parser reads
the calls; alone, it reads them out of the whole text and leaves the rest verbatim. The markers
are special tokens: ToolParserCaps.reads has the server keep them when detokenizing.

format_calls writes each call as `<|start|>assistant<|channel|>commentary to=functions.NAME
<|constrain|>json<|message|>{...}<|call|>`; format_response a tool result as harmony's tool
message (`<|start|>functions.NAME to=assistant<|channel|>commentary<|message|>...<|end|>`).
gpt-oss's chat template renders tools itself (a TypeScript `namespace functions`), so the
parser does not declare `prompts`; its tools_prompt writes that namespace, for completeness.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from core.contract.capabilities import ToolParserCaps
from core.contract.hookspecs import hookimpl
from core.contract.tools import MAX_ARGUMENT_DEPTH, Piece, ToolCall, held_back, skip_ws, value_end

CORE_PLUGIN_API = ">=1.10,<2"

START, CHANNEL, MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
END, RETURN, CALL, CONSTRAIN = "<|end|>", "<|return|>", "<|call|>", "<|constrain|>"
HEADS = (START, CHANNEL)  # where a header begins
ENDS = (CALL, END, RETURN)  # where a body ends (a new header also ends it)
MARKERS = (START, CHANNEL, MESSAGE, CONSTRAIN, END, RETURN, CALL)
_RECIPIENT = re.compile(r"(?:^|\s)to=(\S+?)(?=\s|$)")

CAPS = ToolParserCaps(
    # in gpt-oss's chat template (its tool calls are rendered `... to=functions.NAME
    # <|channel|>commentary json<|message|>{...}<|call|>`)
    markers=(CALL, "<|channel|>commentary"),
    families={"gpt_oss"},
    aliases={"openai", "harmony", "gpt_oss"},
    arguments_key="arguments",
    prompts=False,
    parallel_calls=True,  # harmony holds several call messages (gpt-oss stops at <|call|>)
    reads=MARKERS,
    priority=30,
    description="gpt-oss harmony: <|channel|>commentary to=functions.NAME ... "
                "<|message|>{json}<|call|>",
)


def _next_head(text: str, pos: int) -> int:
    """Index of the next header marker at or after pos (len(text): none)."""
    hits = [i for m in HEADS if (i := text.find(m, pos)) >= 0]
    return min(hits) if hits else len(text)


def _body_end(text: str, pos: int) -> int:
    """Where a message body starting at pos ends as harmony delimits it (its end marker
    included), markers searched as text: the first end marker, or the next header, or the
    end of the text."""
    hits = [(i, m) for m in ENDS + HEADS if (i := text.find(m, pos)) >= 0]
    if not hits:
        return len(text)
    i, m = min(hits)
    return i + len(m) if m in ENDS else i


def call_name(header: str) -> str | None:
    """The function a header calls (`header` from its first marker up to `<|message|>`), or
    None when it opens no function call: no `commentary` channel, a role other than the
    assistant, no recipient `functions.NAME` (or two recipients)."""
    if header.startswith(START):
        k = header.find(CHANNEL)
        if k < 0:
            return None
        role_part, channel_part = header[len(START):k], header[k + len(CHANNEL):]
        words = role_part.split()
        if not words or words[0] != "assistant" or any(
                w for w in words[1:] if not w.startswith("to=")):
            return None
    elif header.startswith(CHANNEL):
        role_part, channel_part = "", header[len(CHANNEL):]
    else:
        return None
    if any(m in channel_part for m in (START, CHANNEL, MESSAGE) + ENDS):
        return None  # a second header inside this one: not a well-formed call header
    channel_part = channel_part.replace(CONSTRAIN, " ")
    words = channel_part.split()
    if not words or words[0] != "commentary":
        return None
    recipients = _RECIPIENT.findall(role_part) + _RECIPIENT.findall(channel_part)
    if len(recipients) != 1 or not recipients[0].startswith("functions."):
        return None
    name = recipients[0][len("functions."):]
    return name or None


def _header_start(text: str, k: int, m: int) -> int:
    """The header of the message whose `<|message|>` is at m, the text's first header marker
    being at k: it begins at the last `<|start|>` in between, else the last `<|channel|>` (a
    marker before that opened no message: it is text)."""
    s = text.rfind(START, k, m)
    return s if s >= 0 else text.rfind(CHANNEL, k, m)


class GptOssToolParser:
    """See the module docstring."""

    def parse(self, text: str, final: bool) -> list[Piece]:
        out: list[Piece] = []
        pos = 0  # text[pos:] not yet read
        while True:
            k = _next_head(text, pos)
            if k == len(text):
                tail = text[pos:]
                hold = 0 if final else max(held_back(tail, m) for m in HEADS)
                out.append(tail[:len(tail) - hold])
                return out
            m = text.find(MESSAGE, k)
            if m < 0:  # a header still open: it may become a call's
                out.append(text[pos:k])
                out.append(text[k:] if final else ToolCall(None, "", text[k:], False))
                return out
            h = _header_start(text, k, m)
            body = m + len(MESSAGE)
            name = call_name(text[h:m])
            if name is None:  # another message: verbatim, its body read on for headers
                out.append(text[pos:body])
                pos = body
                continue
            out.append(text[pos:h])
            piece, pos = self._call(text, h, body, name, final)
            out.append(piece)
            if pos is None:
                return out

    def _call(self, text: str, h: int, body: int, name: str, final: bool
              ) -> tuple[Piece, int | None]:
        """The call message whose header starts at h and body at `body`: (the call, or its
        text when malformed, and where reading goes on; None: the text ends in it)."""
        j = skip_ws(text, body)
        if j == len(text):  # no argument yet
            return (text[h:] if final else ToolCall(name, "", text[h:], False)), None
        if text[j] != "{":
            return self._malformed(text, h, body, final)
        try:
            end = value_end(text, j, MAX_ARGUMENT_DEPTH)
        except ValueError:  # not JSON, or nested past the limit
            return self._malformed(text, h, body, final)
        if end is None:  # the arguments go on
            return (text[h:] if final else ToolCall(name, text[j:], text[h:], False)), None
        args = text[j:end]
        try:
            if not isinstance(json.loads(args), dict):
                return self._malformed(text, h, body, final)
        except (ValueError, RecursionError):
            return self._malformed(text, h, body, final)
        after = skip_ws(text, end)
        rest = text[after:]
        if not rest:  # the text ends with the arguments (<|call|> is a stop token)
            return ToolCall(name, args, text[h:end], True), None
        for marker in ENDS:
            if rest.startswith(marker):
                stop = after + len(marker)
                return ToolCall(name, args, text[h:stop], True), stop
        if rest.startswith(HEADS):  # the next message's header ends this one too
            return ToolCall(name, args, text[h:end], True), after
        if not final and any(mk.startswith(rest) for mk in ENDS + HEADS):
            return ToolCall(name, args, text[h:end], True), None  # a marker on its way
        return self._malformed(text, h, body, final)

    @staticmethod
    def _malformed(text: str, h: int, body: int, final: bool) -> tuple[Piece, int | None]:
        """A call message that is no call: its text, through its end as harmony delimits it
        (streaming, less the start of a header it may end with)."""
        stop = _body_end(text, body)
        if stop < len(text):
            return text[h:stop], stop
        hold = 0 if final else max(held_back(text, m) for m in HEADS)
        return text[h:len(text) - hold], None

    def tools_prompt(self, tools: Sequence[dict[str, Any]]) -> str:
        lines = ["# Tools", "", "## functions", "", "namespace functions {", ""]
        for tool in tools:
            f = tool.get("function", tool)
            if f.get("description"):
                lines.append(f"// {f['description']}")
            props = (f.get("parameters") or {}).get("properties") or {}
            if props:
                required = set((f.get("parameters") or {}).get("required") or ())
                lines.append(f"type {f['name']} = (_: {{")
                for key, schema in props.items():
                    if isinstance(schema, dict) and schema.get("description"):
                        lines.append(f"// {schema['description']}")
                    opt = "" if key in required else "?"
                    lines.append(f"{key}{opt}: {_ts_type(schema)},")
                lines.append("}) => any;")
            else:
                lines.append(f"type {f['name']} = () => any;")
            lines.append("")
        lines.append("} // namespace functions")
        return "\n".join(lines)

    def format_calls(self, calls: Sequence[dict[str, Any]]) -> str:
        return "".join(f"{START}assistant{CHANNEL}commentary to=functions.{c['name']} "
                       f"{CONSTRAIN}json{MESSAGE}"
                       + json.dumps(c["arguments"], ensure_ascii=False) + CALL for c in calls)

    def format_response(self, content: str, name: str | None) -> str:
        sender = f"functions.{name}" if name else "functions"
        return f"{START}{sender} to=assistant{CHANNEL}commentary{MESSAGE}{content}{END}"


def _ts_type(schema: Any) -> str:
    """A JSON schema as harmony's TypeScript-like type (the common cases; `any` otherwise)."""
    if not isinstance(schema, dict):
        return "any"
    if "enum" in schema:
        return " | ".join(json.dumps(v, ensure_ascii=False) for v in schema["enum"]) or "any"
    kind = schema.get("type")
    if kind == "array":
        return f"{_ts_type(schema.get('items'))}[]"
    return {"string": "string", "integer": "number", "number": "number",
            "boolean": "boolean", "object": "object", "null": "null"}.get(kind, "any")


@hookimpl
def core_register_tool_parsers(register):
    register("gpt-oss", CAPS, GptOssToolParser)
