"""Reasoning in /v1/chat/completions: the request fields, and each choice's split of its output.

Fields (SGLang's and vLLM's):

    separate_reasoning    true (the default with a reasoning parser) | false: the output as
                          the model wrote it, markers included, all in content. true on a
                          server without a reasoning parser is a 400 naming
                          --reasoning-parser (never a silent no-op); false there changes
                          nothing and is taken.
    stream_reasoning      true (default) | false: streamed, the reasoning comes in one delta
                          once it ends (with the first content, or at the end); it
                          needs reasoning to separate (a 400 otherwise, like
                          separate_reasoning). Not streamed, it changes nothing.
    chat_template_kwargs  {name: JSON value}: extra variables for the chat template
                          (Qwen3's enable_thinking); core.server.protocol checks its shape and
                          size, ServerChatOptions.prepare that the template reads each one.

The plan's reasoning parser (core.contract.reasoning; --reasoning-parser) splits each choice's
output into reasoning and content. A choice starts inside reasoning where the parser's caps say
the model may (starts_in_reasoning) or the rendered prompt leaves it there
(prompt_in_reasoning). A request whose chat_template_kwargs switch thinking off (the caps'
thinking_kwarg set to false) is not split: its output is all content. The leading whitespace of
each part is dropped (streamed and not alike). Non-streamed: message.reasoning_content (null
when there is none) and message.content (null when the reasoning took the whole output);
streamed: `delta.reasoning_content` and `delta.content`. With tools, calls are read from the
content only. A parser whose markers are special tokens' texts (harmony's) needs them kept when
detokenizing: such a request is detokenized with skip_special_tokens false (a client's explicit
true is a 400).
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from core.contract.reasoning import ReasoningParser, ReasoningStream
from core.server.errors import invalid

if TYPE_CHECKING:
    from core.contract.capabilities import ReasoningParserCaps
    from core.contract.json_types import JSONObject
    from core.plan.registry import Registry
    from core.server.engine_api import EngineLike
    from core.server.protocol import ParsedRequest

FLAG = "--reasoning-parser"


@functools.lru_cache(maxsize=8)
def template_variables(template: str) -> frozenset[str] | None:
    """The variables a Jinja chat template reads from outside (None: it cannot be parsed by
    plain Jinja, so nothing can be said)."""
    try:
        import jinja2
        from jinja2 import meta

        env = jinja2.Environment(extensions=["jinja2.ext.loopcontrols", "jinja2.ext.do"])
        return frozenset(meta.find_undeclared_variables(env.parse(template)))
    except Exception:  # a template using tags plain Jinja lacks: read its text instead
        return frozenset(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", template))


class ServerChatOptions:
    """The server's reasoning parser (None: off) and the chat template the options go to."""

    def __init__(self, parser_name: str | None, chat_template: str | None,
                 special_tokens: tuple[str, ...] = (), registry: Registry | None = None):
        self.parser_name = parser_name
        self.parser: ReasoningParser | None = None
        self.caps: ReasoningParserCaps | None = None
        self.keep_special = False  # its markers are special tokens' texts
        if parser_name is not None:
            if registry is None:
                from core.plan.registry import get_registry

                registry = get_registry()
            reg = registry.get("reasoning_parser", parser_name)
            if reg is None:
                raise ValueError(f"reasoning parser {parser_name!r} is not registered")
            self.parser = reg.load()()
            self.caps = reg.caps
            self.keep_special = any(m in special_tokens for m in reg.caps.reads)
        self.chat_template = chat_template

    @classmethod
    def of_engine(cls, engine: EngineLike) -> ServerChatOptions:
        plan = engine.plan_dict() or {}
        tok = engine.tokenizer
        return cls(plan.get("reasoning_parser"), tok.chat_template, tuple(tok.special_tokens))

    def prepare(self, req: ParsedRequest) -> None:
        """Server-dependent checks of a chat request's reasoning fields and template kwargs
        (400s naming the field); decides whether its output is split."""
        if self.parser is None:
            for name, asked in (("separate_reasoning", req.separate_reasoning),
                                ("stream_reasoning", req.stream_reasoning is False)):
                if asked:
                    raise invalid(name, f"{name}: this server runs without a reasoning parser "
                                  f"({FLAG} none), so there is no reasoning to separate; start "
                                  f"it with {FLAG} NAME or auto", code="unsupported")
        kwargs = req.chat_template_kwargs
        if kwargs and self.chat_template:
            known = template_variables(self.chat_template)
            unread = [k for k in kwargs if known is not None and k not in known]
            if unread:
                raise invalid(f"chat_template_kwargs.{unread[0]}", f"chat_template_kwargs."
                              f"{unread[0]}: the chat template never reads `{unread[0]}`, so it "
                              "would have no effect", code="unsupported")
        caps = self.caps
        if caps is not None and caps.thinking_kwarg in kwargs:
            value = kwargs[caps.thinking_kwarg]
            if not isinstance(value, bool):
                raise invalid(f"chat_template_kwargs.{caps.thinking_kwarg}",
                              f"chat_template_kwargs.{caps.thinking_kwarg} must be true or false",
                              code="invalid_type")
        req.split_reasoning = self.parser is not None and req.separate_reasoning is not False \
            and not (caps is not None and caps.thinking_kwarg is not None
                     and kwargs.get(caps.thinking_kwarg) is False)
        if req.split_reasoning and self.keep_special:
            if req.sampling.get("skip_special_tokens") is True:
                raise invalid("skip_special_tokens", f"skip_special_tokens: the reasoning "
                              f"parser {self.parser_name} reads special tokens ("
                              f"{', '.join(caps.reads if caps else ())}), which skipping would "
                              "remove; leave it out, or send separate_reasoning false",
                              code="unsupported")
            req.sampling["skip_special_tokens"] = False

    def reader(self, req: ParsedRequest, prompt: str | None) -> ChoiceReasoning | None:
        """What splits one choice's output (None: not split), given its rendered prompt."""
        if not req.split_reasoning or self.parser is None or self.caps is None:
            return None
        start = self.caps.starts_in_reasoning or self.parser.prompt_in_reasoning(prompt or "")
        return ChoiceReasoning(self.parser, start, req.stream_reasoning is not False)


@dataclass
class ChoiceReasoning:
    """One choice's split: whole (`split`) or streamed (`feed`, then `finish`)."""

    parser: ReasoningParser
    in_reasoning: bool
    incremental: bool = True  # stream_reasoning: send reasoning as it comes
    _stream: ReasoningStream | None = None
    _started: tuple[bool, bool] = (False, False)  # a non-space character sent: reasoning, content
    _held: str = ""  # reasoning kept back under stream_reasoning false
    content: str = ""  # the content streamed so far (tool calls are read from it)

    def split(self, text: str) -> tuple[str | None, str]:
        """(reasoning or None when there is none, content) of a finished output."""
        reasoning, content = self.parser.split(text, self.in_reasoning)
        reasoning, content = reasoning.lstrip(), content.lstrip()
        return reasoning or None, content

    def _trim(self, reasoning: str, content: str) -> tuple[str, str]:
        """Leading whitespace of each part dropped, as split drops it."""
        r_on, c_on = self._started
        if not r_on:
            reasoning = reasoning.lstrip()
        if not c_on:
            content = content.lstrip()
        self._started = (r_on or bool(reasoning), c_on or bool(content))
        return reasoning, content

    def feed(self, piece: str, final: bool) -> JSONObject:
        """The delta fields for a new piece of output (final: the output ended)."""
        if self._stream is None:
            self._stream = self.parser.stream(self.in_reasoning)
        reasoning, content = self._stream.feed(piece)
        if final:
            r2, c2 = self._stream.finish()
            reasoning, content = reasoning + r2, content + c2
        reasoning, content = self._trim(reasoning, content)
        if not self.incremental:  # the reasoning in one piece, once it ended
            self._held += reasoning
            reasoning = ""
            if self._held and (content or final):
                reasoning, self._held = self._held, ""
        self.content += content
        out: JSONObject = {}
        if reasoning:
            out["reasoning_content"] = reasoning
        if content:
            out["content"] = content
        return out

