"""Build a plugin's C source into a shared library on first use, and load it with ctypes.

For CPU kernels shipped as source (plugins/quant/gguf, plugins/ops/cpu_c,
plugins/attention/cpu_c): the library is compiled with the machine's C compiler (`cc`, or $CC)
into a cache directory
($CORE_KERNEL_CACHE, else ~/.cache/core-serve/kernels) under a name that hashes the source,
the flags and the compiler's version, so a changed source or compiler rebuilds and a second
process reuses the file; builders of one file wait on its lock, so it is compiled once
(`compiled`), and a plan's libraries may be compiled ahead of use (`prebuild`, called by the
factories' `prebuild()` hooks: core/plan/prebuild.py). Libraries link OpenMP (-fopenmp):
torch's own libgomp is already loaded, so they share its thread pool. ctypes releases the GIL
during a call.

Instruction-set variants are the same source compiled with different flags (`ISA_FLAGS`); a
plugin registers one entry per variant with the CPU features it needs (QuantCaps /
LayerOpsCaps `cpu_isa`), so the resolver, not the kernel, picks by what the CPU has.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import subprocess
import tempfile
from pathlib import Path

from core.contract.capabilities import c_compiler
from core.contract.file_lock import exclusive

# variant -> compiler flags; the sources pick their loops by the macros these define
ISA_FLAGS = {
    "avx512_vnni": ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mavx2", "-mfma",
                    "-mf16c"),
    "avx2": ("-mavx2", "-mfma", "-mf16c"),
    "portable": (),
    # AMX tiles (bf16 and int8) beside AVX-512 BF16 / VNNI: Sapphire Rapids and later Xeons
    "amx": ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mavx512bf16", "-mavx2",
            "-mfma", "-mf16c", "-mamx-tile", "-mamx-bf16", "-mamx-int8"),
}
# the CPU features (plugins/hardware/cpu.py spelling) each variant needs
ISA_FEATURES = {
    "avx512_vnni": frozenset({"avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx2", "fma",
                              "f16c"}),
    "avx2": frozenset({"avx2", "fma", "f16c"}),
    "portable": frozenset(),
    "amx": frozenset({"avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "avx2",
                      "fma", "f16c", "amx_tile", "amx_bf16", "amx_int8"}),
}
# the longest a process waits for another's compile of the same library before compiling it too
BUILD_WAIT_S = 600.0
BASE_FLAGS = ("-O3", "-std=c11", "-fopenmp", "-shared", "-fPIC")


# headers the sources include (`#include "cbf16.h"`): this directory is on the include path
INCLUDE = Path(__file__).parent
HEADERS = ("cbf16.h", "camx.h", "cexp.h", "gq_act.h")


def cache_dir() -> Path:
    root = os.environ.get("CORE_KERNEL_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "core-serve" / "kernels"


def _version(cc: str) -> str:
    try:
        return subprocess.run([cc, "--version"], capture_output=True, text=True,
                              timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def compiled(source: Path, variant: str, extra: tuple[str, ...] = ()) -> Path:
    """The path of `source`'s library for one ISA variant, compiled first if the cache lacks
    it; RuntimeError with the compiler's message when it cannot be built. One compile per
    file across threads and processes: the compile holds an exclusive lock on the file's
    `.lock` beside it (core.contract.file_lock), and a caller that waited on the lock (at
    most BUILD_WAIT_S) finds the library made."""
    cc = c_compiler()
    if cc is None:
        raise RuntimeError("no C compiler found (set CC, or install gcc / clang)")
    flags = (*BASE_FLAGS, *ISA_FLAGS[variant], *extra, f"-I{INCLUDE}")
    headers = b"".join((INCLUDE / h).read_bytes() for h in HEADERS)
    key = hashlib.sha256(source.read_bytes() + headers + " ".join(flags).encode()
                         + _version(cc).encode()).hexdigest()[:16]
    tag = "_".join([variant, *(f[2:].split("=")[0].lower() for f in extra if f[:2] == "-D")])
    out = cache_dir() / f"{source.stem}_{tag}_{key}.so"
    if out.exists():
        return out
    # another builder of this file: wait for its result (core.contract.file_lock; without a
    # lock both build, and os.replace keeps the file whole)
    with exclusive(out.with_suffix(".lock"), BUILD_WAIT_S):
        if not out.exists():
            _compile(cc, flags, source, variant, out)
    return out


def _compile(cc: str, flags: tuple[str, ...], source: Path, variant: str, out: Path) -> None:
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    proc = subprocess.run([cc, *flags, str(source), "-o", tmp, "-lm"], capture_output=True,
                          text=True)
    if proc.returncode != 0:
        os.unlink(tmp)
        raise RuntimeError(f"building {source.name} ({variant}) failed: "
                           f"{proc.stderr.strip()[-2000:]}")
    os.replace(tmp, out)  # atomic: a reader never sees half a library


@functools.cache
def build(source: Path, variant: str, extra: tuple[str, ...] = ()) -> ctypes.CDLL:
    """The loaded library of `source` for one ISA variant (compiled if the cache lacks it);
    RuntimeError with the compiler's message when it cannot be built. `extra`: more flags
    (macros such as -DAMX_EMULATE), part of the cache key like the rest."""
    return ctypes.CDLL(str(compiled(source, variant, extra)))


def prebuild(source: Path, variant: str, extra: tuple[str, ...] = ()) -> bool:
    """Compile ahead of use (core.plan.prebuild): True when the library is in the cache
    afterwards. A failure is not raised here; build() reports it when the engine asks."""
    try:
        compiled(source, variant, extra)
    except (OSError, RuntimeError):
        return False
    return True
