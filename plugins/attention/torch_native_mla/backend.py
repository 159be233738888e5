"""`torch_native_mla`'s class: the kit's PyTorch MLA (plugins/_kit/mla_torch.py), as it is."""

from __future__ import annotations

from plugins._kit.mla_torch import TorchMLA


class TorchNativeMLA(TorchMLA):
    """The MLA reference backend: materialised extend, absorbed decode, one request at a
    time."""
