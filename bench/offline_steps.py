"""The offline path's host work per step, in one process and one thread, split by stage.

    python bench/offline_steps.py                        # 256 x (64 in, 128 out), tiny model
    python bench/offline_steps.py --profile /tmp/p.prof  # + cProfile of the measured run

Builds the worker's core in this process (core.engine.worker.build_engine_core on the tiny
random Llama of bench/offline_host.py, --load-format dummy, on the CPU) and the client's side
(an EngineClient without a worker: its per-request states and `_on_item`, the offline
Engine's stream), then drives one offline batch step by step, as the two processes do:
scheduler step (forward and sampling timed apart) -> the worker's output items -> encode ->
decode -> the client's deltas -> the offline Engine's chunks. Times are this thread's CPU
seconds (time.thread_time; other load on the machine inflates them little), or wall seconds
with --clock wall (the default off the CPU: with --device cuda and --model-dir of a real
config, the forward's time is then where the host waits for the device). It runs on the tree
before the re-plan too (f182670: core.worker, core.ipc, core.client, core.engine), so the same
script compares the two. --overlap turns on the overlap schedule (a GPU's) on the CPU.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import json
import queue
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from offline_host import make_model_dir, prompts  # noqa: E402

T = time.thread_time  # main() may switch it to time.perf_counter (--clock wall)


def tree_api() -> dict:
    """The functions of this tree (HEAD's module layout, or the one before the re-plan)."""
    try:
        from core.engine import worker
        from core.frontend import client, offline
        from core.messages import SamplingParams, StepOutput, decode, encode
        from core.plan.args import make_server_args
        new = True
    except ImportError:
        from core.config import make_server_args
        from core.sampling import SamplingParams

        from core import client, ipc, worker
        from core import engine as offline
        StepOutput, encode, decode = ipc.StepOutput, ipc.encode, ipc.decode
        new = False
    return {"worker": worker, "client": client, "offline": offline, "SP": SamplingParams,
            "StepOutput": StepOutput, "encode": encode, "decode": decode,
            "make_server_args": make_server_args, "new": new}


class Timer:
    def __init__(self) -> None:
        self.s: collections.Counter[str] = collections.Counter()

        self.depth: collections.Counter[str] = collections.Counter()

    def wrap(self, obj: object, name: str, key: str) -> None:
        """Count obj.name's thread CPU time under `key` (once where such calls nest)."""
        fn = getattr(obj, name)

        def timed(*a, **k):
            if self.depth[key]:
                return fn(*a, **k)
            self.depth[key] += 1
            t = T()
            try:
                return fn(*a, **k)
            finally:
                self.s[key] += T() - t
                self.depth[key] -= 1
        setattr(obj, name, timed)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--profile", default=None, help="cProfile the last repeat into this file")
    p.add_argument("--overlap", action="store_true",
                   help="the overlap schedule (a GPU's; off on the CPU otherwise)")
    p.add_argument("--engine-extra", default=None, help="more server args, as JSON")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None, help="default: float32 on the CPU, else bfloat16")
    p.add_argument("--model-dir", default=None,
                   help="a config.json + tokenizer directory (default: the tiny Llama)")
    p.add_argument("--clock", choices=("thread", "wall"), default=None,
                   help="thread CPU time (default on the CPU) or wall time (default elsewhere)")
    a = p.parse_args()
    global T
    if (a.clock or ("thread" if a.device == "cpu" else "wall")) == "wall":
        T = time.perf_counter
    api = tree_api()
    W, C, OFF = api["worker"], api["client"], api["offline"]

    d = Path(tempfile.mkdtemp(prefix="offline_steps_"))
    try:
        dtype = a.dtype or ("float32" if a.device == "cpu" else "bfloat16")
        kw = {"load_format": "dummy", "device": a.device, "dtype": dtype,
              "max_running_requests": a.num_prompts,
              "max_total_tokens": a.num_prompts * (a.input_len + a.output_len) + 4096,
              **(json.loads(a.engine_extra) if a.engine_extra else {})}
        model = a.model_dir or make_model_dir(d)
        args = api["make_server_args"](model_path=model, **kw)
        args, plan, spec, registry = W.make_plan(args)
        core = W.build_engine_core(args, plan, spec, registry)
        tok = OFF._load_tokenizer(args)
        sched = core.scheduler
        tm = Timer()
        shapes: list[int] = []  # decode batch sizes, in order
        decode = sched.runner.decode

        def counted(rows, *rest, **k):
            shapes.append(len(rows))
            return decode(rows, *rest, **k)
        sched.runner.decode = counted
        extends = [0]  # extend forwards so far
        extend = sched.runner.extend

        def counted_extend(*a, **k):
            extends[0] += 1
            return extend(*a, **k)
        sched.runner.extend = counted_extend
        tm.wrap(sched.runner, "decode", "forward")
        tm.wrap(sched.runner, "extend", "forward")
        tm.wrap(sched.sampler, "sample", "sample")
        tm.wrap(sched.sampler, "launch", "sample")
        if a.overlap:
            sched.cfg.overlap = True  # SchedulerConfig is a plain dataclass

        client = C.EngineClient.__new__(C.EngineClient)
        client._lock = threading.Lock()
        client._reqs = {}
        engine = OFF.Engine.__new__(OFF.Engine)
        engine.client = client
        client.health = lambda: True
        sp = {"temperature": 0, "max_new_tokens": a.output_len, "ignore_eos": True}

        def one(batch: list[list[int]], tag: str) -> dict:
            q: queue.Queue = queue.Queue()
            rids = []
            for i, ids in enumerate(batch):
                params = api["SP"].from_dict(sp)
                rid = f"{tag}-{i}"
                client._reqs[rid] = C._ReqState(rid, i, params, q.put,
                                                tok.detokenizer(ids, params.skip_special_tokens))
                sched.admit(rid, list(ids), params, None)
                rids.append(rid)
            stream = engine._stream(q, rids)
            if api["new"]:
                stream = engine._chunks(stream)
            tm.s.clear()
            shapes.clear()
            c0 = dict(sched.counters)
            s = collections.Counter()
            steps = tokens = 0
            nbytes = 0
            ext_host = ext_steps = 0.0
            while sched.has_work:
                e0, f0 = extends[0], tm.s["forward"] + tm.s["sample"]
                t0 = T()
                touched = sched.step()
                t1 = T()
                if extends[0] != e0:  # a step with an extend: its host time apart
                    ext_steps += 1
                    ext_host += (t1 - t0) - (tm.s["forward"] + tm.s["sample"] - f0)
                if not touched:
                    s["step"] += t1 - t0
                    continue
                msg = api["StepOutput"](tuple(W._item(r) for r in touched))
                t2 = T()
                data = api["encode"](msg)
                t3 = T()
                got = api["decode"](data)
                t4 = T()
                for item in got.items:
                    client._on_item(item)
                t5 = T()
                for _ in range(q.qsize()):
                    chunk = next(stream)
                    tokens += len(chunk["token_ids"])
                t6 = T()
                s["step"] += t1 - t0
                s["item"] += t2 - t1
                s["encode"] += t3 - t2
                s["decode"] += t4 - t3
                s["on_item"] += t5 - t4
                s["offline"] += t6 - t5
                steps += 1
                nbytes += len(data)
            stream.close()
            out = {k: round(v * 1e3 / steps, 4) for k, v in s.items()}
            out["forward"] = round(tm.s["forward"] * 1e3 / steps, 4)
            out["sample"] = round(tm.s["sample"] * 1e3 / steps, 4)
            out["scheduler"] = round(out["step"] - out["forward"] - out["sample"], 4)
            out["host_no_forward"] = round(sum(out[k] for k in (
                "scheduler", "sample", "item", "encode", "decode", "on_item", "offline")), 4)
            counters = {k: sched.counters[k] - c0.get(k, 0) for k in (
                "steps", "overlapped_steps", "retractions", "decode_tokens", "prefill_tokens")
                if k in sched.counters}
            counters["decode_forwards"] = len(shapes)
            counters["extend_steps"] = int(ext_steps)
            counters["extend_step_sched_ms"] = round(ext_host * 1e3 / max(ext_steps, 1), 3)
            counters["decode_batch_mean"] = round(statistics.fmean(shapes), 2) if shapes else 0
            return {"steps": steps, "tokens": tokens, "bytes_per_step": nbytes // steps,
                    "counters": counters,
                    "ms_per_step": out}

        one(prompts(8, a.input_len, 1), "warm")
        res = []
        for rep in range(a.repeats):
            prof = cProfile.Profile() if a.profile and rep == a.repeats - 1 else None
            if prof:
                prof.enable()
            r = one(prompts(a.num_prompts, a.input_len, 5 + rep), f"r{rep}")
            if prof:
                prof.disable()
                prof.dump_stats(a.profile)
            res.append(r)
            print(json.dumps({"tree": "HEAD layout" if api["new"] else "pre-replan layout",
                              "repeat": rep, **r}), flush=True)
        keys = res[0]["ms_per_step"].keys()
        print(json.dumps({"median_ms_per_step": {
            k: round(statistics.median(r["ms_per_step"][k] for r in res), 4) for k in keys}}))
    finally:
        shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    main()
