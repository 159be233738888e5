"""CPU decode graphs (plugins/hardware/cpu_graphs.py, core/contract/native.py): recorded C calls
replay with the arguments they were given, whatever their types; an engine's greedy answers are
the same with graphs on and off; collectives replay and are waited on; a forward whose work a
graph would miss (a C call made around NativeFn) or cannot replay (a value read back on the
host) is refused at capture, with the reason in the engine's notes, and decode stays eager."""

from __future__ import annotations

import ctypes
import struct
from types import SimpleNamespace

import pytest
import torch

from core.contract.capabilities import c_compiler
from core.contract.native import NativeFn, is_recording, recording

pytestmark = pytest.mark.skipif(c_compiler() is None, reason="CPU graphs need a C compiler")

MIXED = r"""
#include <stdint.h>
/* eleven parameters of every NativeFn kind: some go on the stack, floats in their registers */
int mixed(double *out, int a, float b, int64_t c, double d, float e, void *p, int f, int g,
          int h, float i, int64_t j) {
    out[0] = a; out[1] = b; out[2] = (double)c; out[3] = d; out[4] = e;
    out[5] = (double)(intptr_t)p; out[6] = f; out[7] = g; out[8] = h; out[9] = i;
    out[10] = (double)j;
    return 0;
}
void bump(int64_t *x, int64_t by) { x[0] += by; }
int fails(int code) { return code; }
"""


@pytest.fixture
def lib(tmp_path, monkeypatch):
    from plugins._kit.cbuild import build

    monkeypatch.setenv("CORE_KERNEL_CACHE", str(tmp_path / "cache"))
    src = tmp_path / "mixed.c"
    src.write_text(MIXED)
    raw = build(src, "portable")
    p, i32, i64, f, d = (ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float,
                         ctypes.c_double)
    return SimpleNamespace(
        mixed=NativeFn(raw.mixed, [p, i32, f, i64, d, f, p, i32, i32, i32, f, i64]),
        bump=NativeFn(raw.bump, [p, i64], restype=None),
        fails=NativeFn(raw.fails, [i32]))


def _record(fn):
    from plugins.hardware.cpu_graphs import CpuGraph, _Capture

    cap = _Capture()
    with torch.inference_mode(), cap, recording(cap):
        assert is_recording()
        fn()
    assert not is_recording()
    return CpuGraph(cap.steps, cap.keep)


def test_a_replay_passes_every_argument_kind_as_recorded(lib):
    out = torch.zeros(11, dtype=torch.float64)
    counter = torch.zeros(1, dtype=torch.int64)
    args = (-7, 1.25, 2**40 + 3, -2.5e100, 3.0e-3, 0xABCDEF0, 11, -12, 13, -0.375, -(2**50))

    def forward():
        assert lib.mixed(out.data_ptr(), *args) == 0
        lib.bump(counter.data_ptr(), 5)
        out.mul_(2)  # a torch op between native calls: replayed in its place

    graph = _record(forward)
    want = [2 * float(v) for v in args]
    want[1], want[4], want[9] = (2 * struct.unpack("<f", struct.pack("<f", v))[0]
                                 for v in (1.25, 3.0e-3, -0.375))
    assert out.tolist() == want and counter.item() == 5
    assert (graph.native_calls, graph.torch_ops) == (2, 1)
    out.zero_()
    graph.replay()
    graph.replay()
    assert out.tolist() == want and counter.item() == 15  # each replay ran every call once


def test_a_failing_native_call_in_a_replay_is_named(lib):
    code = torch.zeros(1, dtype=torch.int64)

    def forward():
        lib.bump(code.data_ptr(), 1)
        lib.fails(0)

    graph = _record(forward)
    graph.parts[0][0][3][2] = 7  # the recorded argument of fails(): now it returns 7
    with pytest.raises(RuntimeError, match="fails returned 7"):
        graph.replay()
    assert code.item() == 2


def test_native_fn_refuses_types_a_replay_cannot_pass():
    libc = ctypes.CDLL(None)
    with pytest.raises(TypeError, match="NativeFn takes"):
        NativeFn(libc.strlen, [ctypes.c_char])
    with pytest.raises(TypeError, match="returns int or nothing"):
        NativeFn(libc.strlen, [ctypes.c_void_p], restype=ctypes.c_size_t)


def test_a_collective_is_replayed_and_waited_on(tmp_path):
    """Tensor parallelism's all-reduce (gloo, here a group of one) is recorded like an op and
    replayed in its place; the replay waits on its Work as dist.all_reduce does."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    try:
        x = torch.ones(4)

        def forward():
            x.mul_(2)
            dist.all_reduce(x)
            x.add_(1)

        graph = _record(forward)
        assert graph.torch_ops == 3 and x.tolist() == [3.0] * 4
        x.fill_(5)
        graph.replay()
        assert x.tolist() == [11.0] * 4
    finally:
        dist.destroy_process_group()


def test_a_host_read_is_refused_at_capture():
    from plugins.hardware.cpu_graphs import GraphUnsafe

    x = torch.ones(3)
    with pytest.raises(GraphUnsafe, match="reads a value back on the host"):
        _record(lambda: x.sum().item())


# -- an engine ---------------------------------------------------------------------------------

def _core(path, **kw):
    from core.engine.worker import build_engine_core, make_plan
    from core.plan.args import make_server_args

    args, plan, spec, registry = make_plan(make_server_args(
        model_path=str(path), device="cpu", dtype="bfloat16", max_total_tokens=1024,
        disable_overlap_schedule=True, cuda_graph_max_bs=4, **kw))
    return build_engine_core(args, plan, spec, registry), plan


def _generate(core_, prompts, new=12):
    sched = core_.scheduler
    for i, p in enumerate(prompts):
        sched.add_request(f"r{i}", p, {"max_new_tokens": new, "temperature": 0,
                                       "ignore_eos": True})
    got = {}
    while sched.has_work:
        for r in sched.step():
            got[r.rid] = list(r.output_ids)
    return got


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from model_fixtures import write_tiny_model

    return write_tiny_model("llama", tmp_path_factory.mktemp("llama"), head_dim=64)


PROMPTS = [[5, 6, 7, 8, 9], list(range(10, 40)), [3, 4]]  # 3 rows: a padded bucket of 4


def test_greedy_answers_are_the_same_with_cpu_graphs_on_and_off(tiny):
    on, plan = _core(tiny)
    assert plan.cuda_graph and plan.decode_attention.startswith("cpu_c"), plan.notes
    gr = on.scheduler.runner.graph_runner
    assert gr is not None and sorted(gr.graphs) == [1, 2, 4]
    assert any(n.startswith("captured decode graphs") for n in on.info.notes), on.info.notes
    want_calls = gr.graphs[1].native_calls
    assert want_calls > 0
    got = _generate(on, PROMPTS)
    assert gr.replays > 0
    off, plan_off = _core(tiny, disable_cuda_graph=True)
    assert not plan_off.cuda_graph and off.scheduler.runner.graph_runner is None
    assert _generate(off, PROMPTS) == got


def test_a_native_call_made_around_native_fn_fails_the_check(tiny, monkeypatch):
    """A layer op whose C call bypasses NativeFn is not recorded: the replay on other inputs
    differs from the eager forward, so capture fails and decode runs eagerly (same answers)."""
    from plugins.ops import cpu_c as ops_variants
    from plugins.ops.cpu_c import ops

    core_off, plan = _core(tiny, disable_cuda_graph=True)
    want = _generate(core_off, PROMPTS)
    lib = ops.library(ops_variants.VARIANTS[plan.layer_ops][1])  # the plan's build of ops.c
    bypass = lib.co_add_rms_norm.cfunc  # the raw ctypes function: unrecorded
    monkeypatch.setattr(lib, "co_add_rms_norm", bypass)
    core_, _ = _core(tiny)
    notes = [n for n in core_.info.notes if "graph capture off: capture failed" in n]
    assert notes and "differs from the eager forward" in notes[0], core_.info.notes
    assert core_.scheduler.runner.graph_runner is None
    assert _generate(core_, PROMPTS) == want


def test_a_gguf_embedding_out_of_range_is_an_index_error():
    """The GGUF kernels range-check looked-up rows in C (a graph records the call; a Python
    check would read the ids back on the host)."""
    from plugins.quant.gguf.formats import dequantize_ref, from_ggml, random_blocks
    from plugins.quant.gguf.kernels import Kernels

    w = from_ggml("Q8_0", random_blocks("Q8_0", 8, 64), 64)
    k = Kernels("portable")
    got = k.dequantize(w, torch.float32, torch.tensor([0, 7]))
    assert torch.equal(got, dequantize_ref(w)[[0, 7]])
    for bad in ([8], [-1], [0, 9]):
        with pytest.raises(IndexError, match="out of range for 8 rows"):
            k.dequantize(w, torch.float32, torch.tensor(bad))
