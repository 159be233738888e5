"""The old name of plugins/_kit/w8a8_triton.py (bench/sweep_quant.py and bench/sass_count.py use
it): the same module."""

import sys

from plugins._kit import w8a8_triton

sys.modules[__name__] = w8a8_triton
