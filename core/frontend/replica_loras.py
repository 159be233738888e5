"""LoRA adapters over data-parallel replicas: `ReplicaLoras`, the router's record of which
adapters every replica holds and which of them requests may name.

Every replica must hold the same adapters, since a request naming one may be routed to any of
them. An adapter loaded or unloaded at run time changes N workers, one RPC each, and any of
them may refuse (a bad folder, a rank over the maximum, an adapter a running request uses) or
be gone. So that the replicas agree whatever happens:

- one update at a time (a lock): two loads or unloads never interleave;
- load: on every replica at once; if one refuses or fails, the adapter is unloaded again from
  those that took it, and the refusal names the replica. It becomes visible to requests (the
  router routes a request naming it) only once every replica holds it;
- unload: refused here, with nothing changed, while a request the router sent is still using
  it; otherwise the adapter is hidden first (a new request naming it is refused, as for an
  unknown adapter) and then unloaded on every replica. If one refuses, it is loaded again,
  from the folder it came from, on those that dropped it, and shown again.

Where a step back fails too (a replica died, a folder vanished since), the adapter stays
hidden, on the replicas that still hold it, and the error log says so; unloading it then
finishes the job. A request naming a hidden or unknown adapter is refused by the router as
the worker refuses one: 404, "LoRA adapter 'x' is not loaded".
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Collection, Mapping, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import TYPE_CHECKING

from core.frontend.client import EngineError

if TYPE_CHECKING:
    from core.contract.json_types import JSON
    from core.frontend.client import EngineClient

log = logging.getLogger("core.frontend.replica_loras")

LOAD, UNLOAD = "load_lora", "unload_lora"  # EngineClient.update_lora's ops


def not_loaded(name: str) -> str:
    """The refusal of a request naming an adapter that is not loaded (the worker's words)."""
    return f"LoRA adapter {name!r} is not loaded"


@dataclass
class _Held:
    """One adapter: its folder (to load it again), the replicas holding it, and whether
    requests may name it."""

    path: str
    replicas: set[int]
    visible: bool


class ReplicaLoras:
    """The adapters of `replicas` (see the module docstring); `start`: those named at start
    (name -> folder), which every replica loaded before it was ready. `pool` runs one RPC per
    replica at once."""

    def __init__(self, replicas: Sequence[EngineClient], pool: Executor,
                 start: Mapping[str, str]):
        self._replicas, self._pool = replicas, pool
        every = range(len(replicas))
        self._held = {name: _Held(path, set(every), True) for name, path in start.items()}
        self._users: Counter[str] = Counter()  # unfinished routed requests, per adapter
        self._lock = threading.Lock()  # _held and _users
        self._update = threading.Lock()  # one load or unload at a time

    def names(self) -> dict[str, str]:
        """The adapters requests may name: name -> the folder it was loaded from."""
        with self._lock:
            return {name: h.path for name, h in self._held.items() if h.visible}

    def acquire(self, name: str) -> bool:
        """Count a request naming `name` that is about to be routed; False (not counted) when
        requests may not name it (unknown, half loaded, being unloaded)."""
        with self._lock:
            held = self._held.get(name)
            if held is None or not held.visible:
                return False
            self._users[name] += 1
            return True

    def release(self, name: str) -> None:
        """A request counted by acquire finished (or was never sent)."""
        with self._lock:
            self._users[name] -= 1
            if self._users[name] <= 0:
                del self._users[name]

    def update(self, op: str, name: str, path: str | None = None,
               timeout: float = 120.0) -> JSON:
        """EngineClient.update_lora over every replica: load (op "load_lora", from folder
        `path`) or unload ("unload_lora") adapter `name`. ValueError with the reason when
        refused, naming the replica that refused (no replica keeps a change, unless stepping
        back failed too: the module docstring); EngineError when a replica's engine is gone
        or did not answer within `timeout` s. Returns the lowest replica's answer."""
        if op not in (LOAD, UNLOAD):
            raise ValueError(f"unknown LoRA operation {op!r} (load_lora, unload_lora)")
        with self._update:
            return self._load(name, path or "", timeout) if op == LOAD else \
                self._unload(name, timeout)

    # -- the two updates ---------------------------------------------------------------------

    def _load(self, name: str, path: str, timeout: float) -> JSON:
        with self._lock:
            if name in self._held:  # hidden ones too: unload those first
                raise ValueError(f"LoRA adapter {name!r} is already loaded")
        done, failed = self._on(range(len(self._replicas)), LOAD, name, path, timeout)
        if not failed:
            with self._lock:  # every replica holds it: requests may name it from now on
                self._held[name] = _Held(path, set(done), True)
            return done[min(done)]
        left = set(done)
        if left:  # step back: no replica keeps what the others refused
            undone, _ = self._on(left, UNLOAD, name, None, timeout)
            left -= set(undone)
        if left:
            with self._lock:
                self._held[name] = _Held(path, left, False)
            log.error("LoRA adapter %r stays loaded, hidden from requests, on data-parallel "
                      "replica(s) %s after a failed load; unload it", name, sorted(left))
        raise _refusal(failed)

    def _unload(self, name: str, timeout: float) -> JSON:
        with self._lock:
            held = self._held.get(name)
            if held is None:
                raise ValueError(not_loaded(name))
            users = self._users[name]
            if users:
                raise ValueError(f"LoRA adapter {name!r} is in use by {users} request(s); "
                                 "unload it once they finish")
            was_visible, held.visible = held.visible, False  # no new request names it now
            holders = sorted(held.replicas)
        done, failed = self._on(holders, UNLOAD, name, None, timeout)
        if not failed:
            with self._lock:
                del self._held[name]
            return done[min(done)]
        back, _ = self._on(done, LOAD, name, held.path, timeout)  # step back
        with self._lock:
            held.replicas -= set(done) - set(back)
            held.visible = was_visible and len(held.replicas) == len(self._replicas)
        if len(held.replicas) < len(self._replicas):
            log.error("LoRA adapter %r is left on data-parallel replica(s) %s only, hidden "
                      "from requests, after a refused unload; unload it", name,
                      sorted(held.replicas))
        raise _refusal(failed)

    def _on(self, replicas: Collection[int], op: str, name: str, path: str | None,
            timeout: float) -> tuple[dict[int, JSON], dict[int, BaseException]]:
        """`op` on each of `replicas` at once: (answers, failures), by replica."""
        futs = {i: self._pool.submit(self._replicas[i].update_lora, op, name, path, timeout)
                for i in replicas}
        done: dict[int, JSON] = {}
        failed: dict[int, BaseException] = {}
        for i, fut in futs.items():
            exc = fut.exception()
            if exc is None:
                done[i] = fut.result()
            else:
                failed[i] = exc
        return done, failed


def _refusal(failed: Mapping[int, BaseException]) -> BaseException:
    """The error to raise for the first replica that failed, naming it."""
    i = min(failed)
    exc = failed[i]
    if not isinstance(exc, (EngineError, ValueError)):
        return exc
    kind = EngineError if isinstance(exc, EngineError) else ValueError
    named = kind(f"data-parallel replica {i}: {exc}")
    named.__cause__ = exc
    return named
