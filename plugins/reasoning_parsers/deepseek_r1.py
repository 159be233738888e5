"""`deepseek-r1` reasoning parser: the reasoning inside `<think>...</think>`, the answer after it,
as DeepSeek-R1 (and its distills, QwQ) write it. Its chat templates put `<think>\n` at the end of
the generation prompt, so the model usually begins inside its reasoning without writing the
open marker: an output with no `</think>` is all reasoning (the model stopped while thinking).
An open marker it writes anyway is dropped; after `</think>` everything is content.
"""

from __future__ import annotations

from core.contract.capabilities import ReasoningParserCaps
from core.contract.hookspecs import hookimpl
from core.contract.reasoning import ThinkParser

CORE_PLUGIN_API = ">=1.9,<2"

CAPS = ReasoningParserCaps(
    markers=("<think>",),
    reads=("<think>", "</think>"),
    starts_in_reasoning=True,
    families={"deepseek_v3", "qwen2"},
    aliases={"deepseek_r1"},
    priority=10,
    description="DeepSeek-R1 / QwQ: <think>reasoning</think>answer, may start in reasoning",
)


class DeepSeekR1ReasoningParser(ThinkParser):
    """See the module docstring."""


@hookimpl
def core_register_reasoning_parsers(register):
    register("deepseek-r1", CAPS, DeepSeekR1ReasoningParser)
