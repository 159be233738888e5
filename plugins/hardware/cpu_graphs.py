"""Decode graphs on the CPU: the capture half of core.contract.graphs.GraphRunner, which replays.

A batch-1 decode step of a small model on a CPU is a few hundred C calls of 5-50 us each, and
the Python around them (module calls, argument checks, ctypes' conversions, torch.empty) costs
a fifth to a third of the step. A CPU graph removes that Python: one eager forward per bucket
is recorded, and a replay calls the recorded C functions in order from C (`cg_run` over a
generated trampoline per signature), one ctypes call for every run of consecutive C calls.

What is recorded (core.contract.native has the plugin's side of the contract):
- every NativeFn call: its address, signature and argument values (pointers as addresses);
- every torch op, through a TorchDispatchMode: allocations and views need nothing at replay
  (the graph keeps every tensor the capture made alive, so the addresses the C calls were given
  stay valid, and a view's memory is its base's); any other op is replayed by calling it again
  on the same tensors, its outputs copied into the captured ones where it made new ones;
- collectives of torch.distributed (`c10d.*`: tensor parallelism's all-reduce over gloo) are
  replayed like other ops, and the replay waits on the Work they return, as the eager call's
  `all_reduce` does; every rank replays the same sequence, so the collectives pair up;
- refused (the capture fails, decode stays eager, the note says why): an op that reads a value
  back on the host (`.item()`, a Python number out). Reads that bypass torch's dispatcher
  (`.tolist()`, `.numpy()`) are not seen here; the check below catches them when they change
  what the forward computes.

After each bucket's capture the graph is checked: replayed on other inputs and compared with an
eager forward on the same inputs, bit for bit. A native call made around NativeFn (not
recorded), or a forward whose work depends on Python state that a replay does not refresh,
shows up there as a mismatch, and capture fails with that reason instead of replaying wrong
answers.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import struct
import tempfile
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from core.contract.graphs import GraphRunner
from core.contract.native import NativeFn, recording
from plugins._kit.cbuild import build, cache_dir

_aten = torch.ops.aten
# allocations: their contents are undefined, so a replay has nothing to redo
ALLOC = frozenset({_aten.empty.memory_format, _aten.empty_like.default,
                   _aten.empty_strided.default, _aten.new_empty.default,
                   _aten.new_empty_strided.default})
# collectives whose ops return a Work to wait on (the functional ones return tensors and are
# waited on by an op of their own, replayed like any other)
COLLECTIVES = frozenset({"c10d"})

_C = {"p": "void *", "i": "int", "l": "int64_t", "f": "float", "d": "double"}
_ARG = {"p": "(void *)a[{}]", "i": "(int)a[{}]", "l": "a[{}]", "f": "cg_f(a[{}])",
        "d": "cg_d(a[{}])"}


class GraphUnsafe(RuntimeError):
    """The forward does something a CPU graph cannot replay."""


def trampolines_source(sigs: tuple[tuple[str, bool], ...]) -> str:
    """C source of cg_run and one trampoline per (signature, returns int) in `sigs`: the
    compiler applies the calling convention, so any mix of the NativeFn codes is called
    correctly."""
    out = ["#include <stdint.h>", "#include <string.h>",
           "static inline float cg_f(int64_t v) { int32_t b = (int32_t)v; float f; "
           "memcpy(&f, &b, 4); return f; }",
           "static inline double cg_d(int64_t v) { double d; memcpy(&d, &v, 8); return d; }",
           "typedef int (*cg_tramp)(void *, const int64_t *);"]
    for n, (sig, returns) in enumerate(sigs):
        params = ", ".join(_C[c] for c in sig) or "void"
        call = "(({} (*)({}))fn)({})".format("int" if returns else "void", params,
                                             ", ".join(_ARG[c].format(i) for i, c in enumerate(sig)))
        body = f"return {call};" if returns else f"{call}; return 0;"
        out.append(f"static int t{n}(void *fn, const int64_t *a) {{ {body} }}")
    out.append("static const cg_tramp T[] = {" + ", ".join(f"t{n}" for n in range(len(sigs)))
               + "};")
    out.append("""/* steps first..first+n-1: fns[i](args + offs[i]) through trampoline tr[i]; stops at
 * the first nonzero return, its step in *failed */
int cg_run(int64_t n, void *const *fns, const int32_t *tr, const int64_t *args,
           const int64_t *offs, int64_t *failed) {
    for (int64_t i = 0; i < n; i++) {
        int rc = T[tr[i]](fns[i], args + offs[i]);
        if (rc != 0) { *failed = i; return rc; }
    }
    return 0;
}""")
    return "\n".join(out) + "\n"


@functools.cache
def trampolines(sigs: tuple[tuple[str, bool], ...]) -> ctypes.CDLL:
    """cg_run for these signatures, built once (plugins/_kit/cbuild caches it by source)."""
    src = trampolines_source(sigs)
    d = cache_dir()
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"cgraph-{hashlib.sha256(src.encode()).hexdigest()[:16]}.c"
    if not path.exists():
        fd, tmp = tempfile.mkstemp(dir=d, suffix=".c")
        with os.fdopen(fd, "w") as f:
            f.write(src)
        os.replace(tmp, path)
    lib = build(path, "portable")
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.cg_run.argtypes = [i64, p, p, p, p, p]
    lib.cg_run.restype = ctypes.c_int
    return lib


def _encode(code: str, v: Any) -> int:
    if code == "p":
        v = v.value if isinstance(v, ctypes.c_void_p) else v
        return 0 if v is None else int(v)
    if code == "f":
        return struct.unpack("<i", struct.pack("<f", float(v)))[0]
    if code == "d":
        return struct.unpack("<q", struct.pack("<d", float(v)))[0]
    return int(v)


def _storages(args: Any) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in tree_leaves(args)
            if isinstance(t, torch.Tensor)}


class _Capture(TorchDispatchMode):
    """Records one forward: NativeFn calls (core.contract.native.Recorder) and torch ops."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # torch would wrap __torch_dispatch__ in dynamo's disable, whose first call imports
        # torch._dynamo (~900 modules, 1.2 s and 150 MB here); nothing is compiled inside it
        return False

    def __init__(self) -> None:
        super().__init__()
        self.steps: list[tuple] = []
        self.keep: list[Any] = []  # every tensor the forward made: the graph's memory

    def native(self, fn: NativeFn, args: tuple, rc: Any) -> None:
        self.steps.append(("c", fn, [_encode(c, a) for c, a in zip(fn.signature, args,
                                                                   strict=True)]))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if isinstance(out, torch.Tensor):  # the common case, without a tree walk
            outs = [out]
        else:
            leaves = tree_leaves(out)
            outs = [o for o in leaves if isinstance(o, torch.Tensor)]
            # a collective's Work is waited on at replay (_thunk); any other value is a host read
            if func.namespace not in COLLECTIVES and len(outs) < sum(o is not None
                                                                     for o in leaves):
                raise GraphUnsafe(f"{func} reads a value back on the host, which a replay "
                                  f"would not read again")
        self.keep.append((args, kwargs, outs))
        if func in ALLOC:
            return out
        if func.is_view and self._aliases(outs, args, kwargs):
            return out  # memory of its inputs: nothing to redo
        self.steps.append(("t", func, args, kwargs, outs))
        return out

    @staticmethod
    def _aliases(outs: list[torch.Tensor], args: tuple, kwargs: dict) -> bool:
        """Whether every output lies in an input's memory (a view op that made a copy, as
        reshape may, does not)."""
        mine = {o.untyped_storage().data_ptr() for o in outs}
        first = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if first is not None and mine == {first.untyped_storage().data_ptr()}:
            return True
        return mine <= _storages((args, kwargs))


def _thunk(func: Any, args: tuple, kwargs: dict, outs: list[torch.Tensor]) -> Callable[[], None]:
    collective = func.namespace in COLLECTIVES

    def run() -> None:
        leaves = tree_leaves(func(*args, **kwargs))
        for o, r in zip(outs, (t for t in leaves if isinstance(t, torch.Tensor)), strict=True):
            if r.data_ptr() != o.data_ptr():  # a new tensor (an in-place op returns its own)
                o.copy_(r)
        if collective:  # what the eager call (dist.all_reduce, async_op=False) does next
            for w in leaves:
                if hasattr(w, "wait") and not isinstance(w, torch.Tensor):
                    w.wait()
    return run


class CpuGraph:
    """One bucket's recorded forward: runs of C calls (one cg_run each) and torch ops."""

    def __init__(self, steps: list[tuple], keep: list[Any]):
        self.keep = keep
        sigs = tuple(sorted({(s[1].signature, s[1].returns) for s in steps if s[0] == "c"}))
        self.lib = trampolines(sigs) if sigs else None
        index = {s: i for i, s in enumerate(sigs)}
        self.parts: list[Any] = []  # (cg_run's arrays, names) or a torch op's thunk
        self.native_calls = sum(1 for s in steps if s[0] == "c")
        self.torch_ops = len(steps) - self.native_calls
        run: list[tuple] = []

        def flush() -> None:
            if not run:
                return
            fns = torch.tensor([s[1].address for s in run], dtype=torch.int64)
            tr = torch.tensor([index[(s[1].signature, s[1].returns)] for s in run],
                              dtype=torch.int32)
            offs, flat = [], []
            for s in run:
                offs.append(len(flat))
                flat.extend(s[2])
            args = torch.tensor(flat or [0], dtype=torch.int64)
            names = [s[1].name for s in run]
            self.parts.append(((len(run), fns, tr, args,
                                torch.tensor(offs, dtype=torch.int64)), names))
            run.clear()

        for s in steps:
            if s[0] == "c":
                run.append(s)
            else:
                flush()
                self.parts.append(_thunk(*s[1:]))
        flush()
        self._failed = ctypes.c_int64(0)

    def replay(self) -> None:
        with torch.inference_mode():
            for part in self.parts:
                if callable(part):
                    part()
                    continue
                (n, fns, tr, args, offs), names = part
                rc = self.lib.cg_run(n, fns.data_ptr(), tr.data_ptr(), args.data_ptr(),
                                     offs.data_ptr(), ctypes.byref(self._failed))
                if rc != 0:
                    raise RuntimeError(f"{names[self._failed.value]} returned {rc} in a CPU "
                                       f"decode graph's replay")


class CpuGraphRunner(GraphRunner):
    """core.contract.graphs.GraphRunner with CPU graphs (this module's docstring)."""

    def capture(self) -> None:
        self.prepare_capture()
        with torch.inference_mode():
            for i, bs in enumerate(self.sizes):
                batch = self.capture_batch(bs)
                if i == 0:  # warm-up: the layers' bindings and lazy builds outside the record
                    self._forward(batch, bs)
                cap = _Capture()
                with cap, recording(cap):
                    self._forward(batch, bs)
                graph = CpuGraph(cap.steps, cap.keep)
                self._check(graph, batch, bs)
                self.graphs[bs] = graph
                self.batches[bs] = batch

    def _check(self, graph: CpuGraph, batch: Any, bs: int) -> None:
        """Replay on inputs the capture did not see (tokens 1..bs at position 0, every row's
        K/V into the sink slot 0), then the eager forward on the same inputs: their logits must
        agree bit for bit. A call the capture missed (a KV store, a product) leaves the
        replay's answer on the capture's inputs, and the two differ."""
        self.packed[0, :bs] = torch.arange(1, bs + 1) % max(1, self.logits.shape[1])
        graph.replay()
        replayed = self.logits[:bs].clone()
        self._forward(batch, bs)
        eager = self.logits[:bs]
        same = (replayed == eager) | (replayed.isnan() & eager.isnan())
        if not bool(same.all()):
            diff = (replayed - eager).abs().nan_to_num(float("inf")).max().item()
            raise GraphUnsafe(f"the replay of batch size {bs} differs from the eager forward "
                              f"(max |diff| {diff:.3g}): some work of the forward was not "
                              f"recorded (a native call made without NativeFn, or per-step "
                              f"state outside the batch's tensors)")
        self.packed[0, :bs] = 0
