"""`torch_native`'s class: the kit's pure-PyTorch paged attention (plugins/_kit/torch_attention.py),
which the CPU decode backends (cpu_c, numba_cpu) build on too."""

from plugins._kit.torch_attention import CAUSAL_BLOCK, TorchNativeAttention, TorchNativeMeta

__all__ = ["CAUSAL_BLOCK", "TorchNativeAttention", "TorchNativeMeta"]
