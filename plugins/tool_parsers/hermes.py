"""`hermes` tool-call parser: calls as JSON objects inside `<tool_call>...</tool_call>` tags,
the format of Hermes 2 Pro / Hermes 3 and of Qwen2.5 / Qwen3 (SGLang: `qwen25`, `qwen`;
vLLM: `hermes`):

    Let me look that up.
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Text outside the tags is content. A block whose JSON is not a call (not an object, no name,
arguments not an object, other keys) stays in the content as written, tags included. A block
ends at the first closing tag after its JSON object (an argument may hold `</tool_call>` in a
string). The last block may lack its closing tag (the model stopped right after the JSON).
Its tools prompt lists the functions inside `<tools></tools>` and asks for one `<tool_call>`
block per call; tool results go back inside `<tool_response></tool_response>`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from core.contract.capabilities import ToolParserCaps
from core.contract.hookspecs import hookimpl
from core.contract.tools import Piece, ToolCall, call_at, held_back, skip_ws, value_end

CORE_PLUGIN_API = ">=1.5,<2"

OPEN, CLOSE = "<tool_call>", "</tool_call>"

CAPS = ToolParserCaps(
    markers=(OPEN,),
    families={"qwen2", "qwen2_moe", "qwen3", "qwen3_moe"},
    aliases={"qwen25", "qwen", "qwen3"},
    arguments_key="arguments",
    prompts=True,
    priority=20,
    description="Hermes / Qwen2.5 / Qwen3: <tool_call>{json}</tool_call>",
)


def _close(text: str, body: int) -> int:
    """Where the block whose JSON starts at text[body] closes: the first closing tag after the
    JSON object (a string in the arguments may hold the tag's text); -1 while the object is
    open. Where the body is no JSON object, the first closing tag after it."""
    start = body
    if text[body:body + 1] == "{":
        try:
            end = value_end(text, body)
        except ValueError:  # not JSON: the block ends at its first closing tag
            end = body
        if end is None:
            return -1
        start = end
    return text.find(CLOSE, start)


class HermesToolParser:
    """See the module docstring."""

    def parse(self, text: str, final: bool) -> list[Piece]:
        out: list[Piece] = []
        pos = 0
        while True:
            k = text.find(OPEN, pos)
            if k < 0:
                tail = text[pos:]
                out.append(tail if final else tail[:len(tail) - held_back(tail, OPEN)])
                return out
            out.append(text[pos:k])
            body = skip_ws(text, k + len(OPEN))
            close = _close(text, body)
            if close < 0:  # the last block, still open
                out.append(self._open_block(text, k, body, final))
                return out
            got = call_at(text[:close], body, True) if text[body:body + 1] == "{" else None
            end = close + len(CLOSE)
            if got is not None and skip_ws(text, got[1]) == close:
                call = got[0]
                out.append(ToolCall(call.name, call.arguments, text[k:end], True))
            else:
                out.append(text[k:end])
            pos = end

    def _open_block(self, text: str, k: int, body: int, final: bool) -> Piece:
        if body == len(text):
            return text[k:] if final else ToolCall(None, "", text[k:], False)
        if text[body] != "{":
            return text[k:]
        got = call_at(text, body, final)
        if got is None:
            return text[k:]
        call, end = got
        if end is not None:
            rest = text[end:]
            if rest.strip() and not (not final and CLOSE.startswith(rest.strip())):
                return text[k:]  # something other than the closing tag after the JSON
        return ToolCall(call.name, call.arguments, text[k:], call.complete)

    def tools_prompt(self, tools: Sequence[dict[str, Any]]) -> str:
        lines = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        return ("# Tools\n\nYou can call functions to help answer the user. Their JSON "
                f"signatures, one per line, are inside <tools></tools> tags:\n<tools>\n{lines}\n"
                "</tools>\n\nTo call a function, answer with a JSON object holding its name and "
                "its arguments inside <tool_call></tool_call> tags, one block per call:\n"
                "<tool_call>\n{\"name\": <function name>, \"arguments\": <arguments as a JSON "
                "object>}\n</tool_call>")

    def format_calls(self, calls: Sequence[dict[str, Any]]) -> str:
        return "\n".join(f"{OPEN}\n" + json.dumps({"name": c["name"], "arguments": c["arguments"]},
                                                  ensure_ascii=False) + f"\n{CLOSE}"
                         for c in calls)

    def format_response(self, content: str, name: str | None) -> str:
        return f"<tool_response>\n{content}\n</tool_response>"


@hookimpl
def core_register_tool_parsers(register):
    register("hermes", CAPS, HermesToolParser)
