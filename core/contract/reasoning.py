"""The reasoning-parser protocol (`reasoning_content` in /v1/chat/completions), as a plugin kind.

A parser registers `register(name, ReasoningParserCaps, factory)`; the plan picks one from the
chat template once the tokenizer is loaded (`--reasoning-parser NAME|auto|none`, the plan's
`reasoning_parser`; core.plan.reasoning.resolve_reasoning_parser). The server builds it once:
`parser = factory()`. It separates the model's reasoning from its answer, and implements
ReasoningParser:

    prompt_in_reasoning(prompt) -> bool
        whether the rendered prompt leaves the model inside reasoning (a template that writes
        the start marker itself, as DeepSeek-R1's `<think>\\n` at the end of the generation
        prompt); the core also starts in reasoning where ReasoningParserCaps.starts_in_reasoning
        says the model may begin there without the marker.
    split(text, in_reasoning) -> (reasoning, content)
        a finished output; in_reasoning: the output begins inside reasoning. Never raises,
        whatever the text. The markers are left out of both parts and nothing else is:
        every other character of `text` is in one part, in order.
    stream(in_reasoning) -> ReasoningStream
        the same for an output that grows: `feed(piece) -> (reasoning delta, content delta)`
        for each new piece of text, then `finish() -> (reasoning delta, content delta)` once
        it ended. The deltas never hold a marker or part of one; a stream holds back only the
        text at its end that may be the start of a marker (`held_back`), and gives it out as
        soon as it cannot be, or at finish(). Whatever the pieces, the deltas joined are
        exactly split(whole text, in_reasoning).
    format(reasoning, content, in_reasoning) -> str
        the text the model writes for this reasoning and answer (starting inside reasoning
        when in_reasoning: without the start marker); split reads it back as exactly
        (reasoning, content). The conformance suite writes its texts with it.

Parsers are pure text work: no tokenizer, no device. Markers must survive detokenizing: when
one is the text of a special token (harmony's `<|channel|>`), the core detokenizes the
request with special tokens kept (a client's skip_special_tokens: true is then refused).

What the core does with the parts (core.server.reasoning): the leading whitespace of each part
is dropped (the newline after `<think>`, the blank line after `</think>`), in the streamed
deltas as in the message; the reasoning goes out as `reasoning_content`, the content as
`content`, where tool calls are then read (reasoning first, then tool calls). A request
whose chat_template_kwargs switch thinking off (ReasoningParserCaps.thinking_kwarg set to
false) is not split: its output is all content.

The conformance suite (conformance/reasoning_parser_suite.py; `pytest
--conformance-reasoning-parser NAME -rs`) checks all of the above on a parser.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from core.contract.tools import held_back

__all__ = ["REASONING_PARSER_OFF", "ReasoningParser", "ReasoningStream", "ThinkParser",
           "held_back", "longest_hold"]

REASONING_PARSER_OFF = "none"


@runtime_checkable
class ReasoningStream(Protocol):
    def feed(self, piece: str) -> tuple[str, str]: ...

    def finish(self) -> tuple[str, str]: ...


@runtime_checkable
class ReasoningParser(Protocol):
    def prompt_in_reasoning(self, prompt: str) -> bool: ...

    def split(self, text: str, in_reasoning: bool) -> tuple[str, str]: ...

    def stream(self, in_reasoning: bool) -> ReasoningStream: ...

    def format(self, reasoning: str, content: str, in_reasoning: bool) -> str: ...


# -- helpers for parsers ---------------------------------------------------------------------------

def longest_hold(text: str, markers: tuple[str, ...]) -> int:
    """How many characters at the end of `text` may be the start of one of `markers`."""
    return max((held_back(text, m) for m in markers), default=0)


class ThinkParser:
    """A reasoning format of one open and one close marker (`<think>`...`</think>`): before the
    reasoning the open marker starts it (text before it is content), inside it the close
    marker ends it, and after it everything is content (an answer may mention `<think>`). An
    open marker inside the reasoning is dropped (a model that starts in reasoning may still
    write it). Subclasses set OPEN and CLOSE."""

    OPEN = "<think>"
    CLOSE = "</think>"

    @property
    def markers(self) -> tuple[str, ...]:
        return (self.OPEN, self.CLOSE)

    def prompt_in_reasoning(self, prompt: str) -> bool:
        tail = prompt.rstrip()
        return tail.rfind(self.OPEN) > tail.rfind(self.CLOSE)

    def walk(self, text: str, in_reasoning: bool, done: bool = False
             ) -> tuple[str, str, bool, bool]:
        """(reasoning, content, in reasoning after it, reasoning ended) of `text`, from the
        state before it."""
        if done:
            return "", text, False, True
        reasoning: list[str] = []
        content: list[str] = []
        pos, state = 0, in_reasoning
        while pos < len(text):
            if done:
                content.append(text[pos:])
                break
            marker = self.CLOSE if state else self.OPEN
            k = text.find(marker, pos)
            end = len(text) if k < 0 else k
            if state:
                reasoning.append(text[pos:end].replace(self.OPEN, ""))
            else:
                content.append(text[pos:end])
            if k < 0:
                break
            pos = k + len(marker)
            done = state  # a close marker ends the reasoning for good
            state = not state
        return "".join(reasoning), "".join(content), state and not done, done

    def split(self, text: str, in_reasoning: bool) -> tuple[str, str]:
        reasoning, content, _, _ = self.walk(text, in_reasoning)
        return reasoning, content

    def stream(self, in_reasoning: bool) -> ReasoningStream:
        return _ThinkStream(self, in_reasoning)

    def format(self, reasoning: str, content: str, in_reasoning: bool) -> str:
        return ("" if in_reasoning else self.OPEN) + reasoning + self.CLOSE + content


class _ThinkStream:
    """ThinkParser's stream: the settled text is walked once, from the state it left."""

    def __init__(self, parser: ThinkParser, in_reasoning: bool):
        self.parser, self.state, self.done = parser, in_reasoning, False
        self.pending = ""

    def feed(self, piece: str) -> tuple[str, str]:
        text = self.pending + piece
        # after the reasoning nothing is a marker: nothing to hold back
        end = len(text) if self.done else len(text) - longest_hold(text, self.parser.markers)
        reasoning, content, self.state, self.done = self.parser.walk(text[:end], self.state,
                                                                     self.done)
        self.pending = text[end:]
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        text, self.pending = self.pending, ""
        reasoning, content, self.state, self.done = self.parser.walk(text, self.state, self.done)
        return reasoning, content
