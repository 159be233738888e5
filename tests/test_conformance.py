"""The attention conformance suite over the built-in backends.

On a CPU machine: torch_native, flex_attention (FlexAttention's eager path runs on CPU) and triton
under TRITON_INTERPRET=1 (Triton >= 3.9; fp16/fp32: the interpreter gets bf16 wrong), small
shapes. On a GPU machine, `pytest -m gpu tests/test_conformance.py --conformance-full` runs the
cuda cases at full size. The suite itself lives in conformance/ (shipped for third-party backends).
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

# Before any Triton kernel module is imported (they are imported lazily by the backend factory):
# without a GPU, Triton kernels run in the interpreter.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from conformance.attention_suite import *  # noqa: E402,F401,F403
from conformance.attention_suite import conformance_params  # noqa: E402
from core.plan.registry import get_registry  # noqa: E402

BUILTIN = ("torch_native", "triton", "flex_attention")


def test_builtin_backends_are_registered():
    """A stale install (entry points from an older pyproject) would silently shrink the suite."""
    registered = set(get_registry().kind("attention"))
    missing = [n for n in BUILTIN if n not in registered]
    assert not missing, (f"attention backends {missing} not registered: reinstall core-serve "
                         f"(pip install --no-deps -e .) so its entry points are current")


def test_suite_covers_every_builtin_backend_on_cpu(request):
    """Each built-in backend gets cases on CPU (triton through the interpreter), with both
    phases, GQA ratios 1/4/8, head dims 64/128 and page sizes 1/16/64."""
    if request.config.getoption("conformance_backend", default=None):
        pytest.skip("--conformance-backend narrows the suite on purpose")
    params = [p.values[0] for p in conformance_params(request.config)
              if p.values[0] is not None and p.values[0].device == "cpu"]
    interpreted = (os.environ.get("TRITON_INTERPRET", "") not in ("", "0")
                   and importlib.util.find_spec("triton") is not None)
    for name in BUILTIN if interpreted else ("torch_native", "flex_attention"):
        cases = [p.case for p in params if p.backend.name == name]
        verify = {"verify_rows"} if get_registry().get("attention", name).caps.verify_rows \
            else set()
        assert {c.mode for c in cases} == {"decode", "extend"} | verify, name
        assert {c.group for c in cases} == {1, 4, 8}, name
        assert {64, 128} <= {c.head_dim for c in cases}, name
        assert {c.page_size for c in cases} == {1, 16, 64}, name
    if interpreted:
        triton_dtypes = {p.case.dtype for p in params if p.backend.name == "triton"}
        assert triton_dtypes == {"float16", "float32"}


def test_verify_rows_cases_fail_a_decode_whose_rows_attend_before_all_are_stored():
    """A planted fault: a decode that stores and attends row by row, last row first (as
    parallel programs of a fused store-and-attend kernel may run), reads a later draft's
    poisoned K/V slot and fails the verify_rows cases; in order it would pass."""
    import dataclasses

    from conformance.attention_cases import conformance_cases
    from conformance.attention_check import check_case
    from plugins._kit.torch_attention import TorchNativeAttention

    def one_row_at_a_time(order):
        class RowByRow(TorchNativeAttention):
            def forward(self, q, k, v, layer, batch):
                outs = {}
                for i in order(q.shape[0]):
                    one = slice(i, i + 1)
                    sub = dataclasses.replace(
                        batch, input_ids=batch.input_ids[one], positions=batch.positions[one],
                        seq_lens=batch.seq_lens[one], prefix_lens=batch.prefix_lens[one],
                        extend_lens=batch.extend_lens[one], out_cache_loc=batch.out_cache_loc[one],
                        req_pool_indices=batch.req_pool_indices[one],
                        seq_lens_cpu=batch.seq_lens_cpu[one],
                        prefix_lens_cpu=batch.prefix_lens_cpu[one],
                        extend_lens_cpu=batch.extend_lens_cpu[one])
                    sub.attn_meta = self.prepare(sub)
                    outs[i] = super().forward(q[one], k[one], v[one], layer, sub)
                return torch.cat([outs[i] for i in range(q.shape[0])])
        return RowByRow

    reg = get_registry().get("attention", "torch_native")
    case = next(c for c in conformance_cases(reg.caps) if c.mode == "verify_rows")
    in_order = dataclasses.replace(reg, factory=one_row_at_a_time(range))
    check_case(in_order, case, torch.device("cpu"))
    backwards = dataclasses.replace(reg, factory=one_row_at_a_time(
        lambda n: reversed(range(n))))
    with pytest.raises(AssertionError, match="non-finite output"):
        check_case(backwards, case, torch.device("cpu"))
