"""A bench script's run in stages (bench_serving.py, bench_lora_serving.py, bench_spec_gpu.py):
the report's header, each stage timed into report["stage_wall_s"] and the JSON saved after it,
a stage that raises recorded (its name in `failed`, its error returned) while the others still
run: one broken engine or mode must not lose what the rest measured."""

from __future__ import annotations

import argparse
import gc
import json
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from serving_report import jsonable


def new_report(a: argparse.Namespace, gpu: bool) -> dict[str, Any]:
    """date, device, torch and the arguments (less the config dict), and an empty
    stage_wall_s."""
    return {"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
            "device": torch.cuda.get_device_name() if gpu else "cpu", "torch": torch.__version__,
            "args": {k: v for k, v in vars(a).items() if k != "cfg"}, "stage_wall_s": {}}


class Stages:
    """Runs the stages of one report (module doc); `public` makes the saved JSON."""

    def __init__(self, report: dict[str, Any], out: str | None, gpu: bool,
                 public: Callable[[Any], Any] = jsonable):
        self.report, self.out, self.gpu, self.public = report, out, gpu, public
        self.failed: list[str] = []

    def save(self) -> None:
        """The report so far (so a run cut short keeps what it measured)."""
        if self.out:
            Path(self.out).write_text(json.dumps(self.public(self.report), indent=2,
                                                 default=str))

    def __call__(self, name: str, fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
        """fn(*args, **kw); {"error": ...} if it raised (name then in `failed`). Either way
        the stage's seconds are recorded, GPU memory given back (the next engine sizes its KV
        cache from what is free) and the report saved."""
        t = time.perf_counter()
        try:
            return fn(*args, **kw)
        except Exception as exc:  # noqa: BLE001 - one broken stage must not lose the others
            traceback.print_exc()
            self.failed.append(name)
            return {"error": f"{type(exc).__name__}: {exc}"[:2000]}
        finally:
            self.report["stage_wall_s"][name] = round(time.perf_counter() - t, 1)
            gc.collect()
            if self.gpu:
                torch.cuda.empty_cache()
            self.save()
