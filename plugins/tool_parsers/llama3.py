"""`llama3` tool-call parser: Llama 3.1 / 3.2 / 3.3 JSON tool calls (SGLang: `llama3`; vLLM:
`llama3_json`). The whole answer is the call, optionally after `<|python_tag|>` (a special
token: it shows only when special tokens are not skipped), several separated by `;`:

    {"name": "get_weather", "parameters": {"city": "Paris"}}
    <|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"x": 1}}

Text before `<|python_tag|>` is content; without the tag an answer is calls only when it starts
with `{` (after spaces) and is nothing but calls (read so first: an argument may hold the tag's
text in a string). An answer that is not (a JSON answer that is no call, a malformed call, text
after the calls) is content as written. While streaming, an answer starting with `{` is held
back until it is known to be a call, and so are leading spaces. format_calls writes the tag
first, so that calls replayed after an assistant message's content read back as calls.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from core.contract.capabilities import ToolParserCaps
from core.contract.hookspecs import hookimpl
from core.contract.tools import Piece, call_at, held_back, skip_ws

CORE_PLUGIN_API = ">=1.5,<2"

TAG = "<|python_tag|>"
KEYS = ("parameters", "arguments")

CAPS = ToolParserCaps(
    markers=(TAG, '"parameters": dictionary of argument name and its value'),
    families={"llama"},
    aliases={"llama3_json"},
    arguments_key="parameters",
    prompts=True,
    priority=10,
    description="Llama 3.1-3.3 JSON tool calls: {\"name\": ..., \"parameters\": {...}}",
)


class Llama3ToolParser:
    """See the module docstring."""

    def parse(self, text: str, final: bool) -> list[Piece]:
        j = skip_ws(text, 0)
        if j == len(text) and not final:
            return [""]  # spaces may come before a call
        if j < len(text) and text[j] == "{":
            calls = self._calls(text, j, final)
            if calls is not None:
                return calls
        k = text.find(TAG)
        if k < 0:
            return [text if final else text[:len(text) - held_back(text, TAG)]]
        calls = self._calls(text, k + len(TAG), final)
        if calls is None:
            return [text]
        return [text[:k], *calls]

    def _calls(self, text: str, start: int, final: bool) -> list[Piece] | None:
        out: list[Piece] = []
        j = skip_ws(text, start)
        while j < len(text):
            if text[j] != "{":
                return None
            got = call_at(text, j, final, KEYS)
            if got is None:
                return None
            call, end = got
            out.append(call)
            if end is None:
                return out
            j = skip_ws(text, end)
            if j < len(text):
                if text[j] != ";":
                    return None
                j = skip_ws(text, j + 1)
        return out if out or not final else None

    def tools_prompt(self, tools: Sequence[dict[str, Any]]) -> str:
        lines = "\n\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        return ("You can call the functions below. When one helps answer the user, reply with "
                "nothing but a JSON object of the form {\"name\": <function name>, "
                "\"parameters\": <arguments as a JSON object>} (several calls separated by "
                "\"; \"); use literal values, not variables. Otherwise answer in plain text.\n\n"
                + lines)

    def format_calls(self, calls: Sequence[dict[str, Any]]) -> str:
        return TAG + "; ".join(json.dumps({"name": c["name"], "parameters": c["arguments"]},
                                          ensure_ascii=False) for c in calls)

    def format_response(self, content: str, name: str | None) -> str:
        return content


@hookimpl
def core_register_tool_parsers(register):
    register("llama3", CAPS, Llama3ToolParser)
