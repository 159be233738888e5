"""`gpt-oss` reasoning parser: OpenAI's harmony format, as gpt-oss writes it after its generation
prompt (which ends `<|start|>assistant`):

    <|channel|>analysis<|message|>Let me think.<|end|><|start|>assistant<|channel|>final<|message|>Hi!<|return|>

A message is a header (`<|start|>` and a role, `<|channel|>` and a channel name, maybe
` to=...` and `<|constrain|>...`) up to `<|message|>`, then its body up to `<|end|>`,
`<|return|>` or `<|call|>` (or the next header, or the end of the text). The `analysis`
channel's bodies are reasoning, the `final` channel's are content; the markup is dropped. A
message on any other channel (`commentary`: tool calls and preambles) goes to the content
verbatim, markup included, for the `gpt-oss` tool parser to read (plugins/tool_parsers/gpt_oss.py:
a commentary message to functions.NAME is a call; the two agree on the channels).
Text outside any message is content. A header the text ends inside is markup with no message
yet: dropped. The markers are special tokens: the core keeps them when it detokenizes.
"""

from __future__ import annotations

from dataclasses import dataclass

from core.contract.capabilities import ReasoningParserCaps
from core.contract.hookspecs import hookimpl
from core.contract.reasoning import ReasoningStream, longest_hold

CORE_PLUGIN_API = ">=1.9,<2"

START, CHANNEL, MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
END, RETURN, CALL, CONSTRAIN = "<|end|>", "<|return|>", "<|call|>", "<|constrain|>"
MARKERS = (START, CHANNEL, MESSAGE, END, RETURN, CALL, CONSTRAIN)
ENDS = (END, RETURN, CALL)
REASONING, CONTENT, VERBATIM = "analysis", "final", "verbatim"

CAPS = ReasoningParserCaps(
    markers=(CHANNEL, MESSAGE),
    reads=MARKERS,
    families={"gpt_oss"},
    aliases={"harmony", "gpt_oss"},
    priority=10,
    description="gpt-oss harmony: analysis channel reasoning, final channel content",
)


@dataclass
class _State:
    where: str = "top"  # top | header | body
    header: str = ""  # the header's text so far (markers included)
    body: str = CONTENT  # the open body's kind: analysis | final | verbatim


def _channel(header: str) -> str:
    """The kind of body a header opens."""
    k = header.find(CHANNEL)
    if k < 0:
        return VERBATIM
    name = header[k + len(CHANNEL):].split("<|")[0].split()
    if name == [REASONING] or name == [CONTENT]:
        return name[0]
    return VERBATIM


def _walk(text: str, st: _State) -> tuple[str, str]:
    """(reasoning, content) of `text` from state `st`, which it moves on."""
    reasoning: list[str] = []
    content: list[str] = []
    pos = 0
    while pos < len(text):
        if st.where == "header":
            k = text.find(MESSAGE, pos)
            if k < 0:
                st.header += text[pos:]
                break
            st.header += text[pos:k + len(MESSAGE)]
            pos = k + len(MESSAGE)
            st.where, st.body = "body", _channel(st.header)
            if st.body == VERBATIM:
                content.append(st.header)
            st.header = ""
            continue
        # top or body: up to the next marker that matters there
        stops = (START, CHANNEL) + (ENDS if st.where == "body" else ())
        hits = [(i, m) for m in stops if (i := text.find(m, pos)) >= 0]
        k, m = min(hits) if hits else (len(text), "")
        part = reasoning if st.where == "body" and st.body == REASONING else content
        part.append(text[pos:k])
        if not m:
            break
        pos = k + len(m)
        if m in ENDS:
            if st.body == VERBATIM:
                content.append(m)
            st.where = "top"
        else:  # a new header (a body it interrupts ends here)
            st.where, st.header = "header", m
    return "".join(reasoning), "".join(content)


class GptOssReasoningParser:
    """See the module docstring."""

    def prompt_in_reasoning(self, prompt: str) -> bool:
        st = _State()
        _walk(prompt.rstrip(), st)  # (linear: the prompt is walked once)
        return st.where == "body" and st.body == REASONING

    def split(self, text: str, in_reasoning: bool) -> tuple[str, str]:
        return _walk(text, _State("body", "", REASONING) if in_reasoning else _State())

    def stream(self, in_reasoning: bool) -> ReasoningStream:
        return _Stream(_State("body", "", REASONING) if in_reasoning else _State())

    def format(self, reasoning: str, content: str, in_reasoning: bool) -> str:
        opening = "" if in_reasoning else f"{CHANNEL}{REASONING}{MESSAGE}"
        return (f"{opening}{reasoning}{END}{START}assistant{CHANNEL}{CONTENT}{MESSAGE}{content}"
                f"{RETURN}")


class _Stream:
    def __init__(self, st: _State):
        self.st, self.pending = st, ""

    def feed(self, piece: str) -> tuple[str, str]:
        text = self.pending + piece
        end = len(text) - longest_hold(text, MARKERS)
        self.pending = text[end:]
        return _walk(text[:end], self.st)

    def finish(self) -> tuple[str, str]:
        text, self.pending = self.pending, ""
        return _walk(text, self.st)


@hookimpl
def core_register_reasoning_parsers(register):
    register("gpt-oss", CAPS, GptOssReasoningParser)
