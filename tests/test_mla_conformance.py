"""The MLA conformance suite (conformance/mla_suite.py) over the built-in MLA backends (on a CPU
machine: torch_native_mla and the cpu_c_mla builds), fp32 at page sizes 1 / 16 / 64 and fp16 /
bf16 at page size 16 where declared, a small latent and DeepSeek's 576. (triton_mla runs it
under the Triton interpreter in tests/test_triton_mla.py.)"""

from __future__ import annotations

from conformance.mla_suite import *  # noqa: F401,F403
