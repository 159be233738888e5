"""Native (C) calls that a CPU decode graph can record: the contract for kernels behind ctypes.

A plugin that calls a C function through ctypes wraps it once in `NativeFn`:

    lib = ctypes.CDLL(path)
    gemv = NativeFn(lib.my_gemv, [c_void_p, c_int64, c_float], restype=c_int)
    rc = gemv(x.data_ptr(), n, 0.5)   # a plain ctypes call

Outside a capture that is all it does. While a CPU graph runner captures a decode forward
(plugins/hardware/cpu_graphs.py), each call is also recorded: the function's address, its
signature and the argument values it was given (pointers as addresses). A replay then calls the
recorded functions in order from C, one ctypes call a step instead of one per op, with the same
arguments: the pointers must stay valid and point to the buffers the step reads and writes
(the graph keeps every tensor the capture made alive; the batch's inputs are static buffers).

What a plugin promises when it declares decode graphs on the CPU (`cuda_graph` in its caps):
every native call of its decode path goes through a NativeFn, and nothing its decode does
depends on values read back on the host (an `.item()`, a Python list of lengths): the capture
records torch ops too and refuses host reads, but a native call made around NativeFn would be
missed, which the runner's check after capture (replay against an eager forward on other
inputs) catches as a mismatch and then leaves decode eager.

Signature codes: 'p' pointer (an int address or None), 'i' int (32-bit), 'l' int64, 'f' float,
'd' double; a return of int (rc, 0 = success) or None (void).
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any, Protocol

_CODES = {ctypes.c_void_p: "p", ctypes.c_int: "i", ctypes.c_int32: "i", ctypes.c_int64: "l",
          ctypes.c_long: "l", ctypes.c_float: "f", ctypes.c_double: "d", ctypes.c_char_p: "p"}


class Recorder(Protocol):
    """What a capture installs with `recording` (plugins/hardware/cpu_graphs.py has one)."""

    def native(self, fn: NativeFn, args: tuple, rc: Any) -> None:
        """`fn` was called with `args` and returned `rc` while the capture ran."""


_active: list[Recorder] = []  # the capture in progress (captures run on one thread at a time)


class recording:  # noqa: N801 - used as a context manager, like torch's
    """`with recording(recorder):` every NativeFn call inside is reported to `recorder`."""

    def __init__(self, recorder: Recorder):
        self.recorder = recorder

    def __enter__(self) -> Recorder:
        if _active:
            raise RuntimeError("a native-call recording is already in progress")
        _active.append(self.recorder)
        return self.recorder

    def __exit__(self, *exc: object) -> None:
        _active.clear()


class NativeFn:
    """One C function called through ctypes, recordable by a CPU graph capture."""

    __slots__ = ("cfunc", "name", "signature", "returns", "address")

    def __init__(self, cfunc: Any, argtypes: Sequence[Any], restype: Any = ctypes.c_int):
        """cfunc: the ctypes function (`lib.name`); argtypes: its parameters' ctypes types
        (c_void_p, c_int, c_int64, c_float, c_double); restype: c_int or None (void)."""
        try:
            sig = "".join(_CODES[t] for t in argtypes)
        except KeyError as e:
            raise TypeError(f"{getattr(cfunc, '__name__', cfunc)}: NativeFn takes pointer, int, "
                            f"int64, float and double parameters, not {e.args[0]}") from None
        if restype not in (ctypes.c_int, ctypes.c_int32, None):
            raise TypeError(f"{getattr(cfunc, '__name__', cfunc)}: NativeFn returns int or "
                            f"nothing, not {restype}")
        cfunc.argtypes = list(argtypes)
        cfunc.restype = restype
        self.cfunc = cfunc
        self.name = getattr(cfunc, "__name__", "?")
        self.signature = sig
        self.returns = restype is not None
        self.address = ctypes.cast(cfunc, ctypes.c_void_p).value

    def __call__(self, *args: Any) -> Any:
        rc = self.cfunc(*args)
        if _active:
            _active[0].native(self, args, rc)
        return rc

    def __repr__(self) -> str:
        return f"NativeFn({self.name}, {self.signature!r})"


def is_recording() -> bool:
    """Whether a capture is recording now (a plugin may skip host-side checks it could not
    replay; the C function must then check what they checked)."""
    return bool(_active)
