"""The MLA conformance suite (conformance/mla_suite.py) over the built-in MLA backends (on a CPU
machine: torch_native_mla), fp32, page sizes 1 / 16 / 64, a small latent and DeepSeek's 576."""

from __future__ import annotations

from conformance.mla_suite import *  # noqa: F401,F403
