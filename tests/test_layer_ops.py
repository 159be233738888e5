"""The layer-ops conformance suite over every registered layer-ops plugin (core.testing's
layer_ops_suite): on the CPU the reference and, under the Triton interpreter, the triton ops in
fp32 / fp16; on a GPU (`-m gpu`) every declared dtype."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

from core.testing.layer_ops_suite import *  # noqa: E402,F401,F403
from core.testing.layer_ops_suite import layer_ops_params  # noqa: E402


def test_the_suite_covers_every_op_of_both_built_in_plugins(pytestconfig):
    ids = {p.id for p in layer_ops_params(pytestconfig)}
    gpu = torch.cuda.is_available()
    for op in ("rms_norm", "add_rms_norm", "silu_and_mul", "rotary_qk", "store_kv"):
        assert f"torch-cpu-float32-{op}" in ids
        if gpu:  # the GPU kernels run on the GPU, in every dtype they declare
            assert f"triton-cuda-bfloat16-{op}" in ids and f"triton-cuda-float16-{op}" in ids
        else:
            assert f"triton-cpu-float16-{op}" in ids  # the interpreter runs the GPU kernels here
    assert not any(i.startswith("triton-cpu-bfloat16") for i in ids)


def test_the_suite_fails_a_wrong_op():
    import pytest

    from core.layers.ops_ref import TorchLayerOps
    from core.testing.layer_ops_suite import _check

    class Wrong(TorchLayerOps):
        def silu_and_mul(self):  # gelu where silu belongs
            return lambda x: torch.nn.functional.gelu(x[:, :x.shape[1] // 2]) * \
                x[:, x.shape[1] // 2:]

        def store_kv(self):  # writes K into V's buffer too
            def store(k, v, loc, kb, vb):
                kb[loc], vb[loc] = k, k
                return True
            return store

    cpu = torch.device("cpu")
    for op in ("silu_and_mul", "store_kv"):
        with pytest.raises(AssertionError):
            _check(op, Wrong(), TorchLayerOps(), torch.float32, cpu)
