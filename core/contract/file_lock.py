"""An exclusive lock on a file beside what several processes may build at once (a cache part,
a compiled library), so one builds it and the others wait and read the result. In the
contract because plugins use it too (plugins/_kit/cbuild.py, for kernels they compile).

The lock is `flock` on a lock file (released when the holder exits, however it exits). Where no
lock can be taken (not a POSIX system, a read-only directory, a filesystem without locks) or the
wait runs past `wait_s`, the caller goes on without it: a racing build is only duplicated work,
provided the builder replaces its result atomically (every caller here does).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path

try:
    import fcntl
except ImportError:  # not a POSIX system: no locks, builds may race
    fcntl = None  # type: ignore[assignment]


@contextlib.contextmanager
def exclusive(lock_path: Path, wait_s: float) -> Iterator[bool]:
    """Hold an exclusive lock on `lock_path` (created, with its directory) for the block;
    yields whether it is held (False: the block runs unlocked, as the module doc says)."""
    if fcntl is None:
        yield False
        return
    try:
        lock_path.parent.mkdir(parents=True, exist_ok=True)
        fh = open(lock_path, "a+b")  # noqa: SIM115 - held across the yield
    except OSError:
        yield False
        return
    with fh:
        deadline = time.monotonic() + wait_s
        held = False
        while True:
            try:
                fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                held = True
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    break
                time.sleep(0.05)
            except OSError:
                break
        try:
            yield held
        finally:
            if held:
                fcntl.flock(fh.fileno(), fcntl.LOCK_UN)
