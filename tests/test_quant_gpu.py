"""Quant methods on a CUDA device beyond the conformance suite: the decode kernels under CUDA
graph replay (the split-K counters must reset for every replay), and an engine serving a
dummy Llama-shaped model quantized at load and as an FP8 block checkpoint, with graphs and
without (same greedy tokens: the W8A8 kernels are deterministic).

Run with `pytest -m gpu tests/test_quant_gpu.py` on an sm89+ NVIDIA GPU.
"""

from __future__ import annotations

import json
import random

import pytest

from conformance.model_configs import llama_config

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.gpu

SHAPE = llama_config(hidden_size=2048, intermediate_size=8192, num_hidden_layers=4, head_dim=64)
QWEN3_FP8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
             "weight_block_size": [128, 128]}


def _fp8_gpu() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


@pytest.fixture(autouse=True)
def _needs_fp8_gpu():
    if not _fp8_gpu():
        pytest.skip("needs a CUDA device with fp8 (sm89+)")


@pytest.mark.parametrize("act,block", [("token", None), ("group", (128, 128))])
def test_split_k_decode_kernel_replays_in_a_graph(act, block):
    from plugins._kit.w8a8_triton import small_m_linear

    torch.manual_seed(0)
    n, k = 4096, 4096
    w = (torch.randn(n, k, device="cuda") * 0.05).to(torch.float8_e4m3fn)
    ws = (torch.rand(n // 128, k // 128, device="cuda") if block
          else torch.rand(n, 1, device="cuda")) + 0.5
    x = torch.randn(3, k, device="cuda", dtype=torch.bfloat16)
    eager = small_m_linear(x, w, ws, None, act, block)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = small_m_linear(x, w, ws, None, act, block)
    for _ in range(5):  # every replay must see the counters back at zero
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager)


@pytest.mark.parametrize("rows", [1, 3])
def test_decode_kernels_replay_in_a_graph_at_every_row_count(rows):
    """The one-row kernels (fp8 per channel and block, int4) and the 16-row ones, eager vs
    graph replays, and against the fp32 product of the quantized operands."""
    from conformance.quant_refs import fake_quant_acts
    from plugins._kit.w8a8_triton import small_m_linear
    from plugins.quant.int4 import gemm
    from plugins.quant.int4.packing import dequantize, pack_rows

    torch.manual_seed(1)
    n, k = 6144, 4096
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(n, k, device="cuda") * 0.05).to(torch.float8_e4m3fn)
    w_q = pack_rows(torch.randint(0, 16, (k, n), device="cuda"))
    s4 = (torch.rand(k // 128, n, device="cuda") * 0.01).half()
    z4 = torch.randint(0, 16, (k // 128, n), device="cuda").to(torch.uint8)
    cases = []
    for block in (None, (128, 128)):
        ws = (torch.rand(n // 128, k // 128, device="cuda") if block
              else torch.rand(n, 1, device="cuda")) + 0.5
        wd = w.float() * (ws.repeat_interleave(128, 0).repeat_interleave(128, 1) if block
                          else ws)
        ref = fake_quant_acts(x.float(), "fp8_group" if block else "fp8_token") @ wd.t()
        cases.append((lambda ws=ws, block=block: small_m_linear(
            x, w, ws, None, "group" if block else "token", block), ref, 1e-2))
    ref4 = x.float() @ dequantize(w_q, s4, z4, 128, torch.float32)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    one = gemm.int4_gemv if rows == 1 else gemm.int4_linear
    cases.append((lambda: one(x, w_q, s4, z4, 128, None, sms), ref4, 1e-2))
    for fn, ref, tol in cases:
        eager = fn()
        err = ((eager.float() - ref).norm() / ref.norm()).item()
        assert err < tol, err
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fn()
        for _ in range(3):
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, eager)


def _write(tmp_path, quant: dict | None) -> str:
    from model_fixtures import write_config_model

    cfg = dict(SHAPE)
    if quant:
        cfg["quantization_config"] = quant
    return write_config_model(tmp_path, cfg)


def _greedy(model_dir: str, **kw) -> list[list[int]]:
    from core import Engine

    rng = random.Random(0)
    prompts = [[rng.randrange(1000, 120000) for _ in range(n)] for n in (5, 40, 300)]
    params = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}
    with Engine(model_dir, load_format="dummy", device="cuda", dtype="bfloat16",
                max_total_tokens=8192, **kw) as engine:
        outs = engine.generate(input_ids=prompts, sampling_params=params)
    return [o["output_ids"] for o in outs]


AWQ = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True,
       "version": "gemm"}


@pytest.mark.parametrize("quant,flag", [(None, "fp8"), (None, "w8a8_int8"), (QWEN3_FP8, None),
                                        (AWQ, None)])
def test_quantized_engine_graphs_equal_eager(tmp_path, quant, flag):
    model_dir = _write(tmp_path, quant)
    kw = {"quantization": flag} if flag else {}
    with_graphs = _greedy(model_dir, **kw)
    without = _greedy(model_dir, disable_cuda_graph=True, **kw)
    assert all(len(o) == 24 for o in with_graphs)
    assert with_graphs == without
    json.dumps(with_graphs)  # plain ints
