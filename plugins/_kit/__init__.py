"""Helpers shared by several built-in plugins: C builds (cbuild, cbf16.h), split-K counters and
Triton tiles (splitk, tiles), quant helpers and the W8A8 kernels (quant_common, w8a8_triton), the
pure-PyTorch paged attention the CPU decode backends build on (torch_attention, pool_attention).

A plugin imports from core only core.contract and core.layers, and from plugins only its own
package and this kit (tests/test_layout.py); the kit imports no plugin.
"""
