"""The process boundary's codec (core.messages) on one decode step's output: a StepOutput of N
requests' items, encoded by the worker and decoded by the client each step. Each figure is
beside its floor measured in the same run: json.dumps / json.loads of the same JSON (what any
JSON codec must do; the rest is the typed shape check and the dataclasses).

    python bench/bench_messages.py [--items 256] [--repeat 7] [--number 50]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from core import messages  # noqa: E402


def best(fn, repeat: int, number: int) -> float:
    """Best of `repeat` means over `number` calls, in seconds."""
    fn()
    out = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        for _ in range(number):
            fn()
        out = min(out, (time.perf_counter() - t) / number)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--items", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--number", type=int, default=50)
    a = ap.parse_args()
    items = tuple(messages.OutputItem(f"r{i}", (1234,), None, None, 100, 10, 0)
                  for i in range(a.items))
    msg = messages.StepOutput(items)
    data = messages.encode(msg)
    plain = json.loads(data)
    enc = best(lambda: messages.encode(msg), a.repeat, a.number)
    enc_floor = best(lambda: json.dumps(plain, separators=(",", ":")).encode(), a.repeat,
                     a.number)
    dec = best(lambda: messages.decode(data), a.repeat, a.number)
    dec_floor = best(lambda: json.loads(data), a.repeat, a.number)
    print(f"StepOutput of {a.items} items, {len(data)} bytes")
    print(f"encode {enc * 1e3:.3f} ms = {enc / enc_floor:.2f}x json.dumps ({enc_floor * 1e3:.3f})")
    print(f"decode {dec * 1e3:.3f} ms = {dec / dec_floor:.2f}x json.loads ({dec_floor * 1e3:.3f})")


if __name__ == "__main__":
    main()
