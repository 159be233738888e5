"""`qwen3` reasoning parser: Qwen3's `<think>reasoning</think>answer`. Thinking is switched by the
chat template's `enable_thinking` (a request's `chat_template_kwargs: {"enable_thinking":
false}` makes the template close an empty think block in the prompt, and the output is all
content). The model writes the open marker itself, so an output with no marker is all content;
a template that opens the block in the prompt (Qwen3's thinking-only models) is seen in the
prompt (prompt_in_reasoning), and the output then begins in reasoning.
"""

from __future__ import annotations

from core.contract.capabilities import ReasoningParserCaps
from core.contract.hookspecs import hookimpl
from core.contract.reasoning import ThinkParser

CORE_PLUGIN_API = ">=1.9,<2"

CAPS = ReasoningParserCaps(
    markers=("<think>", "enable_thinking"),
    reads=("<think>", "</think>"),
    starts_in_reasoning=False,
    thinking_kwarg="enable_thinking",
    families={"qwen3", "qwen3_moe"},
    aliases={"qwen3-thinking"},
    priority=20,
    description="Qwen3: <think>reasoning</think>answer, switched by enable_thinking",
)


class Qwen3ReasoningParser(ThinkParser):
    """See the module docstring."""


@hookimpl
def core_register_reasoning_parsers(register):
    register("qwen3", CAPS, Qwen3ReasoningParser)
