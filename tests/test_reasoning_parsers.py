"""The built-in reasoning parsers on canned outputs (deepseek-r1, qwen3, gpt-oss), the plan's choice
(`--reasoning-parser NAME|auto|none`, by the chat template's markers) and `core resolve`'s
explanation of it. The conformance suite over them: tests/test_reasoning_parser_conformance.py;
through the server: tests/test_reasoning_server.py."""

from __future__ import annotations

import json

import pytest

from core.contract.capabilities import DeviceInfo
from core.contract.reasoning import ReasoningParser
from core.plan.args import ServerArgs
from core.plan.plan import Plan, ResolveError
from core.plan.reasoning import resolve_reasoning_parser
from core.plan.registry import get_registry
from plugins.reasoning_parsers.deepseek_r1 import DeepSeekR1ReasoningParser
from plugins.reasoning_parsers.gpt_oss import GptOssReasoningParser
from plugins.reasoning_parsers.qwen3 import Qwen3ReasoningParser

R1_TEMPLATE = ("{% for m in messages %}<｜{{ m.role }}｜>{{ m.content }}{% endfor %}"
               "{% if add_generation_prompt %}<｜Assistant｜><think>\n{% endif %}")
QWEN3_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
                  "{% endfor %}<|im_start|>assistant\n{% if enable_thinking is defined and "
                  "enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}")
HARMONY_TEMPLATE = ("{% for m in messages %}<|start|>{{ m.role }}<|channel|>final<|message|>"
                    "{{ m.content }}<|end|>{% endfor %}<|start|>assistant")


def _stream(parser: ReasoningParser, text: str, start: bool, size: int) -> tuple[str, str]:
    s = parser.stream(start)
    out = [s.feed(text[i:i + size]) for i in range(0, len(text), size)] + [s.finish()]
    return "".join(r for r, _ in out), "".join(c for _, c in out)


@pytest.mark.parametrize("text,start,want", [
    ("<think>\nhmm\n</think>\n\nHi", False, ("\nhmm\n", "\n\nHi")),
    ("hmm</think>Hi", True, ("hmm", "Hi")),  # the template opened it
    ("<think>hmm</think>Hi", True, ("hmm", "Hi")),  # written anyway: dropped
    ("still thinking", True, ("still thinking", "")),  # cut off while thinking
    ("Hi <think>not here</think>", False, ("not here", "Hi ")),
    ("a</think>b</think>c<think>d", True, ("a", "b</think>c<think>d")),  # after it: content
])
def test_deepseek_r1(text, start, want):
    p = DeepSeekR1ReasoningParser()
    assert p.split(text, start) == want
    for size in (1, 2, 5):
        assert _stream(p, text, start, size) == want


def test_qwen3_and_the_prompt():
    p = Qwen3ReasoningParser()
    assert p.split("<think>\nx\n</think>\n\nAnswer", False) == ("\nx\n", "\n\nAnswer")
    assert p.split("Answer only", False) == ("", "Answer only")
    # a thinking-only template opens the block in the prompt; a disabled one closes it
    assert p.prompt_in_reasoning("<|im_start|>assistant\n<think>\n")
    assert not p.prompt_in_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not p.prompt_in_reasoning("<|im_start|>assistant\n")


def test_gpt_oss_harmony_channels():
    p = GptOssReasoningParser()
    text = ("<|channel|>analysis<|message|>User greets. Reply.<|end|><|start|>assistant"
            "<|channel|>final<|message|>Hello! 👋<|return|>")
    assert p.split(text, False) == ("User greets. Reply.", "Hello! 👋")
    for size in (1, 3, 7):
        assert _stream(p, text, False, size) == ("User greets. Reply.", "Hello! 👋")
    # a commentary message (tool calls, preambles) goes to the content verbatim
    call = ("<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
            '{"city":"Paris"}<|call|>')
    assert p.split("<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant"
                   + call, False) == ("Need weather.", "<|start|>assistant" + call)
    assert p.split("<|channel|>analysis<|message|>cut off", False) == ("cut off", "")
    assert p.split("<|channel|>analysis<|mess", False) == ("", "")  # a header, no message yet
    assert p.split("no harmony at all", False) == ("", "no harmony at all")
    assert p.prompt_in_reasoning("<|start|>assistant<|channel|>analysis<|message|>")
    assert not p.prompt_in_reasoning("<|start|>user<|message|>hi<|end|><|start|>assistant")


def _plan(template: str | None, name: str) -> Plan:
    bare = Plan(device=DeviceInfo("cpu", "cpu"), dtype="float32", prefill_attention="x",
                decode_attention="x", moe_runner=None, quant_method="x",
                kv_cache_dtype="float32", page_size=1, cuda_graph=False, model_impl=None)
    return resolve_reasoning_parser(bare, template, ServerArgs(reasoning_parser=name),
                                    get_registry())


@pytest.mark.parametrize("template,chosen,says", [
    (R1_TEMPLATE, "deepseek-r1", "holds its markers (<think>)"),
    (QWEN3_TEMPLATE, "qwen3", "more of them than deepseek-r1's (<think>)"),
    (HARMONY_TEMPLATE, "gpt-oss", "holds its markers (<|channel|>, <|message|>)"),
    ("{{ messages }}", None, "reasoning parser off: no reasoning parser's markers"),
])
def test_auto_picks_by_the_template_markers(template, chosen, says):
    plan = _plan(template, "auto")
    assert plan.reasoning_parser == chosen
    assert any(says in n for n in plan.notes), plan.notes
    cands = [c for c in plan.candidates if c.slot == "reasoning_parser"]
    assert {c.name for c in cands} >= {"deepseek-r1", "qwen3", "gpt-oss"}
    assert [c.name for c in cands if c.chosen] == ([chosen] if chosen else [])


def test_named_none_and_unknown():
    plan = _plan(R1_TEMPLATE, "qwen3")  # named: honoured, with a note
    assert plan.reasoning_parser == "qwen3"
    assert any("shows none of its markers (<think>, enable_thinking)" in n or
               "(--reasoning-parser)" in n for n in plan.notes)
    assert _plan(R1_TEMPLATE, "deepseek_r1").reasoning_parser == "deepseek-r1"  # an alias
    assert _plan(QWEN3_TEMPLATE, "none").reasoning_parser is None  # the default: off
    with pytest.raises(ResolveError) as e:
        _plan(R1_TEMPLATE, "nope")
    assert "unknown reasoning parser 'nope' (--reasoning-parser)" in str(e.value)
    assert "deepseek-r1" in str(e.value) and "gpt-oss" in str(e.value)


def test_core_resolve_explains_the_choice(tmp_path, capsys, clean_plugin_env):
    from core.cli import main

    template = tmp_path / "t.jinja"
    template.write_text(R1_TEMPLATE)
    assert main(["resolve", "--reasoning-parser", "auto", "--chat-template",
                 str(template)]) == 0
    out = capsys.readouterr().out
    assert "reasoning parser   deepseek-r1" in out
    assert "reasoning parser deepseek-r1: the chat template holds its markers (<think>)" in out
    assert "reasoning parser:\n  * deepseek-r1" in out  # its candidates table
    assert f"chat template (for the reasoning parser): --chat-template {template}" in out
    assert main(["resolve", "--json", "--reasoning-parser", "auto", "--chat-template",
                 str(template)]) == 0
    assert json.loads(capsys.readouterr().out)["plan"]["reasoning_parser"] == "deepseek-r1"
    assert main(["resolve", "--reasoning-parser", "nope"]) == 1
    assert "unknown reasoning parser 'nope' (--reasoning-parser)" in capsys.readouterr().out
    assert main(["resolve"]) == 0  # off by default: no row
    assert "reasoning parser" not in capsys.readouterr().out.split("Notes:")[0]


# -- the server's side, without a server (core.server.reasoning) -------------------------------

def _chat_request(**fields):
    from core.server.protocol import parse_chat

    return parse_chat({"messages": [{"role": "user", "content": "hi"}], **fields}, 300, 4096)


def test_harmony_markers_are_kept_when_detokenizing():
    from core.server.errors import APIError
    from core.server.reasoning import ServerChatOptions

    opts = ServerChatOptions("gpt-oss", HARMONY_TEMPLATE, ("<|channel|>", "<|message|>"))
    req = _chat_request()
    opts.prepare(req)
    assert req.split_reasoning and req.sampling["skip_special_tokens"] is False
    with pytest.raises(APIError) as e:
        opts.prepare(_chat_request(skip_special_tokens=True))
    assert e.value.status == 400 and e.value.param == "skip_special_tokens"
    req = _chat_request(skip_special_tokens=True, separate_reasoning=False)
    opts.prepare(req)  # not split: the client's choice stands
    assert not req.split_reasoning and req.sampling["skip_special_tokens"] is True
    # <think> is no special token in Qwen3's tokenizer: nothing to keep
    plain = ServerChatOptions("qwen3", QWEN3_TEMPLATE, ("<|im_start|>", "<|im_end|>"))
    req = _chat_request()
    plain.prepare(req)
    assert req.split_reasoning and "skip_special_tokens" not in req.sampling


def test_template_kwargs_must_be_read_by_the_template():
    from core.server.errors import APIError
    from core.server.reasoning import ServerChatOptions

    opts = ServerChatOptions("qwen3", QWEN3_TEMPLATE)
    req = _chat_request(chat_template_kwargs={"enable_thinking": False})
    opts.prepare(req)
    assert not req.split_reasoning  # thinking off: all content
    with pytest.raises(APIError) as e:
        opts.prepare(_chat_request(chat_template_kwargs={"reasoning_effort": "high"}))
    assert e.value.param == "chat_template_kwargs.reasoning_effort"
    assert "never reads `reasoning_effort`" in str(e.value)


def test_the_real_renderer_takes_template_kwargs():
    from core.tokenizer import render_chat

    msgs = [{"role": "user", "content": "hi"}]
    off = render_chat(QWEN3_TEMPLATE, msgs, True, None, {}, {"enable_thinking": False})
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert render_chat(QWEN3_TEMPLATE, msgs, True, None, {}, {}).endswith("assistant\n")
    assert Qwen3ReasoningParser().prompt_in_reasoning(off) is False
