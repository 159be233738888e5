"""`core generate`: print the plan to stderr, then one answer per prompt on stdout."""

from __future__ import annotations

import argparse
import sys

from core.plan.args import ServerArgs


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
        print(explain(engine.plan), file=sys.stderr)
        for note in engine.info.get("notes", []):
            print(f"  - {note}", file=sys.stderr)
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
