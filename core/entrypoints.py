"""`core generate`: a one-line plan summary (the whole plan with --verbose) on stderr, then one
answer per prompt on stdout."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from core.plan.args import ServerArgs

if TYPE_CHECKING:
    from core.messages import EngineInfo
    from core.plan.plan import Plan


def plan_summary(plan: Plan, info: EngineInfo) -> str:
    """The plan in one line: model, device, quant method, attention, KV pool."""
    attention = plan.decode_attention if plan.prefill_attention == plan.decode_attention else \
        f"{plan.prefill_attention} / {plan.decode_attention}"
    quant = plan.quant_method + ("" if plan.quant_format == "dense" else f" ({plan.quant_format})")
    kv = f", KV cache {info.pool_tokens} tokens" if info.pool_tokens else ""
    return (f"core generate: {plan.model_impl or '?'} on {plan.device.describe()}: {quant}, "
            f"{plan.dtype}, attention {attention}{kv} (--verbose: the whole plan)")


def generate_main(args: ServerArgs, ns: argparse.Namespace) -> int:
    """Generate for ns.prompts (or ns.prompt); chat-templated as a user turn unless ns.raw."""
    from core.frontend.offline import Engine
    from core.plan.resolver import explain

    prompts = getattr(ns, "prompts", None) or getattr(ns, "prompt", None) or []
    if isinstance(prompts, str):
        prompts = [prompts]
    params = {"max_new_tokens": getattr(ns, "max_new_tokens", 64),
              "temperature": getattr(ns, "temperature", 0.0)}
    with Engine(server_args=args) as engine:
        if getattr(ns, "verbose", False):
            print(explain(engine.plan), file=sys.stderr)
            for note in engine.info.notes:
                print(f"  - {note}", file=sys.stderr)
        else:
            print(plan_summary(engine.plan, engine.info), file=sys.stderr)
        tok = engine.tokenizer
        if getattr(ns, "raw", False) or not tok.chat_template:
            inputs = [tok.encode(p) for p in prompts]
        else:
            inputs = [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}]),
                                 add_special_tokens=False) for p in prompts]
        outs = engine.generate(input_ids=inputs, sampling_params=params)
        for i, out in enumerate(outs):
            if len(outs) > 1:
                print(f"--- [{i}] {prompts[i]}")
            print(out["text"])
    return 0
