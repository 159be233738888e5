"""Grammar compiles in child processes: a deadline, cancellation, and a crash costs one child.

Grammar libraries are C++ / Rust code run on client input. One request's schema can overflow
xgrammar's stack (SIGSEGV) or take minutes to compile; run in the worker, that kills the engine
or stalls every client. So the worker's scheduler never calls a grammar library on a new
constraint: `Grammar.submit` hands it to this service, which

- runs `Grammar.compile` (the backend's validate + compile) in one of `workers` child processes
  (started on the first constraint, so an engine that never sees one pays nothing, and stopped
  after IDLE_S seconds with nothing to compile; each builds
  the same backend over the same tokenizer and warms it on a trivial constraint before it
  takes work; at most `workers` compiles run at once, the rest queue in order);
- gives each compile `timeout_s` from the moment a child takes it (queueing does not count);
  past it the child is killed and the request refused (400, naming --grammar-compile-timeout);
- kills the child whose compile every waiting request has left (`cancel`: the scheduler calls
  it when the last request on a compile is aborted); a queued compile is just dropped;
- refuses the request when its child dies (a crash in the library: 400, logged with the signal),
  and starts a fresh child for the next compile;
- brings the result back as bytes (`serialize` / `deserialize`, declared by
  GrammarCaps.serialize) and rebuilds it on a host thread of the worker. A backend that cannot
  serialize has its compile repeated in the worker on that thread, after the child proved that
  the same input compiles, within the deadline, without crashing.

Children speak JSON over a pipe (no pickle): {"id", "kind", "value", "source"} in; {"ready"} or
{"id", "ok", "data" (base64) | "error", "status", "seconds"} out. The counts (`stats`) reach the
scheduler's stats and the server's /metrics.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait

from core.contract.grammar import Constraint, Grammar, GrammarBackendError, GrammarError

log = logging.getLogger("core.contract.grammar")

BOOT_TIMEOUT_S = 120.0  # a child's start: imports, tokenizer, backend
IDLE_S = 300.0  # a child with nothing to compile for this long exits (the next one starts anew)


@dataclass(frozen=True)
class CompilerSpec:
    """What a child needs to build the worker's grammar backend (JSON-able): the server args
    (the tokenizer is loaded from them as the worker loads it), the backend's name, the
    logits' width and the stop tokens."""

    args_json: str
    backend: str
    vocab_size: int
    stop_token_ids: tuple[int, ...]

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))


class _Job:
    __slots__ = ("cid", "constraint", "future", "deadline", "cancelled")

    def __init__(self, cid: int, constraint: Constraint):
        self.cid, self.constraint = cid, constraint
        self.future: Future[object] = Future()  # of the compiled grammar
        self.deadline = 0.0
        self.cancelled = False


class _Child:
    """One compile process and its two pipes (a subprocess, not multiprocessing: the worker is
    a daemonic process, which may not have multiprocessing children). Its death shows as the
    end of its pipe."""

    def __init__(self, spec: CompilerSpec):
        down_r, down_w = os.pipe()  # worker -> child
        up_r, up_w = os.pipe()  # child -> worker
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "core.engine.grammar_compiler", str(down_r), str(up_w)],
                pass_fds=(down_r, up_w), stdin=subprocess.DEVNULL, close_fds=True)
        finally:
            os.close(down_r)
            os.close(up_w)
        self.conn_out = Connection(down_w, readable=False)
        self.conn = Connection(up_r, writable=False)
        self.conn_out.send_bytes(spec.to_json().encode())
        self.ready = False
        self.job: _Job | None = None
        self.idle_since = time.monotonic()
        self.boot_deadline = time.monotonic() + BOOT_TIMEOUT_S

    def exit_code(self) -> int | None:
        try:
            return self.process.wait(5)
        except subprocess.TimeoutExpired:
            return None

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.exit_code()
        self.conn.close()
        self.conn_out.close()


class CompileService:
    """Compiles for one Grammar in `workers` child processes (module docstring)."""

    def __init__(self, grammar: Grammar, spec: CompilerSpec, workers: int = 2,
                 timeout_s: float = 20.0):
        self.grammar, self.spec = grammar, spec
        self.workers, self.timeout_s = max(1, workers), timeout_s
        self._lock = threading.Lock()
        self._queue: deque[_Job] = deque()
        self._jobs: dict[int, _Job] = {}  # id(future) -> its job, while unresolved
        self._children: list[_Child] = []
        self._next = 0
        self._broken: str | None = None  # why children cannot start (the backend's build)
        self._boot_failures = 0  # children in a row that died starting
        self._wake_r, self._wake_w = os.pipe()
        self._thread: threading.Thread | None = None
        self._closed = False
        # a host thread that turns a child's result into this process's compiled grammar
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="core-grammar-load")
        self.counts = {"ok": 0, "refused": 0, "timeout": 0, "crashed": 0, "cancelled": 0,
                       "failed": 0}
        self.seconds = 0.0  # compile seconds in the children, for the compiles that finished

    # -- the scheduler's side ------------------------------------------------------------------

    def submit(self, c: Constraint) -> Future[object]:
        """A Future of the compiled grammar of `c` (which Grammar.check passed): its result,
        or GrammarError (400; GrammarBackendError 500) naming why it was refused."""
        with self._lock:
            job = _Job(self._next, c)
            self._next += 1
            if self._broken is not None:
                job.future.set_exception(GrammarBackendError(self._broken))
                return job.future
            self._jobs[id(job.future)] = job
            self._queue.append(job)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, daemon=True,
                                                name="core-grammar-compiler")
                self._thread.start()
        self._wake()
        return job.future

    def cancel(self, fut: Future[object]) -> None:
        """No request waits for this compile any more: drop it (queued) or kill its child."""
        with self._lock:
            job = self._jobs.get(id(fut))
            if job is None:
                return
            job.cancelled = True
        self._wake()

    def stats(self) -> dict[str, int | float]:
        with self._lock:
            running = sum(c.job is not None for c in self._children)
            return {"grammar_compiles_queued": len(self._queue),
                    "grammar_compiles_running": running,
                    "grammar_compile_processes": len(self._children),
                    **{f"grammar_compiles_{k}": v for k, v in self.counts.items()},
                    "grammar_compile_seconds": round(self.seconds, 3)}

    def close(self) -> None:
        self._closed = True
        self._wake()
        if self._thread is not None:
            self._thread.join(10)
        for child in self._children:
            child.kill()
        self._children.clear()
        for job in list(self._jobs.values()):
            job.future.cancel()
        self._loader.shutdown(wait=False, cancel_futures=True)
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass

    # -- the compiler thread ---------------------------------------------------------------------

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except OSError:  # closed
            pass

    def _finish(self, job: _Job, outcome: str, error: Exception | None = None) -> None:
        """Count the job's outcome and drop it (the caller holds the lock); a cancelled one's
        future is cancelled, a failed one's gets `error` (an ok one's result is the caller's
        to set)."""
        self._jobs.pop(id(job.future), None)
        self.counts[outcome] += 1
        if outcome == "cancelled":
            job.future.cancel()
        elif error is not None:
            job.future.set_exception(error)

    def _run(self) -> None:
        while not self._closed:
            self._dispatch()
            with self._lock:
                children = list(self._children)
            now = time.monotonic()
            deadlines = [c.job.deadline for c in children if c.job is not None]
            deadlines += [c.boot_deadline for c in children if not c.ready]
            deadlines += [c.idle_since + IDLE_S for c in children if c.ready and c.job is None]
            timeout = max(0.0, min(deadlines) - now) if deadlines else None
            ready = wait([self._wake_r] + [c.conn for c in children], timeout)
            if self._wake_r in ready:
                os.read(self._wake_r, 4096)
            dead = [c for c in children if c.conn in ready and not self._receive(c)]
            self._reap(children, dead)

    def _dispatch(self) -> None:
        """Drop cancelled jobs, stop children idle for IDLE_S, hand queued jobs to idle ready
        children, start children while jobs wait and fewer than `workers` run."""
        with self._lock:
            for job in [j for j in self._queue if j.cancelled]:
                self._queue.remove(job)
                self._finish(job, "cancelled")
            for child in list(self._children):
                if child.job is not None and child.job.cancelled:
                    self._kill(child)
            idle = [c for c in self._children if c.ready and c.job is None]
            while self._queue and idle:
                child, job = idle.pop(0), self._queue.popleft()
                c = job.constraint
                try:
                    child.conn_out.send_bytes(json.dumps({"id": job.cid, "kind": c.kind,
                                                      "value": c.value,
                                                      "source": c.source}).encode())
                except OSError:  # the child died: the reaper starts another
                    self._queue.appendleft(job)
                    continue
                child.job = job
                job.deadline = time.monotonic() + self.timeout_s
            now = time.monotonic()
            for child in list(self._children):  # long idle: its memory goes back
                if child.ready and child.job is None and now - child.idle_since >= IDLE_S:
                    self._kill(child)
            busy = sum(c.job is not None for c in self._children)
            want = min(self.workers, busy + len(self._queue))
            while len(self._children) < want and self._broken is None and not self._closed:
                self._children.append(_Child(self.spec))

    def _kill(self, child: _Child) -> None:
        """Stop a child and drop it (the caller holds the lock); its job is cancelled."""
        job = child.job
        child.kill()
        self._children.remove(child)
        if job is not None:
            self._finish(job, "cancelled")

    def _break(self, why: str) -> None:
        """Children cannot start: refuse what waits, and what comes (500, with the reason);
        the caller holds the lock."""
        self._broken = why
        log.error(why)
        for job in list(self._queue):
            self._finish(job, "failed", GrammarBackendError(why))
        self._queue.clear()

    def _receive(self, child: _Child) -> bool:
        """Take one message from `child`; False when its pipe ended (it died)."""
        try:
            msg = json.loads(child.conn.recv_bytes())
        except (EOFError, OSError, ValueError):
            return False
        with self._lock:
            if "ready" in msg:
                if msg["ready"]:
                    child.ready, self._boot_failures = True, 0
                    return True
                self._kill(child)
                self._break(f"grammar backend {self.spec.backend} could not be built in its "
                            f"compile process: {msg.get('error')}")
                return True
            job, child.job = child.job, None
            child.idle_since = time.monotonic()
        if job is None or job.cid != msg.get("id"):
            return True
        self.seconds += float(msg.get("seconds") or 0.0)
        if job.cancelled:
            with self._lock:
                self._finish(job, "cancelled")
            return True
        if not msg.get("ok"):
            status = int(msg.get("status") or 400)
            err = (GrammarBackendError if status >= 500 else GrammarError)(msg.get("error"))
            with self._lock:
                self._finish(job, "refused" if status < 500 else "failed", err)
            return True
        data = msg.get("data")
        self._loader.submit(self._load, job, None if data is None else base64.b64decode(data))
        return True

    def _load(self, job: _Job, data: bytes | None) -> None:
        """The child's result as this process's compiled grammar: deserialized, or (a backend
        that cannot serialize) compiled again here, the child having proved it safe."""
        try:
            g = self.grammar
            compiled = g.backend.deserialize(data) if data is not None else g.compile(
                job.constraint)
        except Exception as exc:  # noqa: BLE001 - reported to the request, 500
            with self._lock:
                self._finish(job, "failed", exc if isinstance(exc, GrammarError) else
                             GrammarBackendError(f"grammar backend {self.grammar.name} could "
                                                 f"not load its compiled grammar: "
                                                 f"{type(exc).__name__}: {exc}"))
            return
        with self._lock:
            self._finish(job, "ok")
        job.future.set_result(compiled)

    def _reap(self, children: list[_Child], dead: list[_Child]) -> None:
        """Children that died (a crash: their pipe ended) or passed a deadline (a compile's,
        or their boot's)."""
        now = time.monotonic()
        with self._lock:
            for child in children:
                if child not in self._children:
                    continue
                job = child.job
                late = job is not None and now >= job.deadline
                stuck = not child.ready and now >= child.boot_deadline
                if not (child in dead or late or stuck):
                    continue
                code = child.exit_code() if child in dead else None
                child.kill()
                self._children.remove(child)
                if job is None:
                    if not child.ready:
                        why = "did not start within " \
                            f"{BOOT_TIMEOUT_S:g} s" if stuck else f"exited ({_exit(code)}) starting"
                        log.warning("grammar compile process %s", why)
                        self._boot_failures += 1
                        if self._boot_failures >= 2:  # the next would fail alike
                            self._break(f"grammar backend {self.spec.backend}'s compile "
                                        f"process {why}")
                    continue
                c = job.constraint
                if late:
                    msg = (f"{c.where}: the {c.kind} constraint did not compile within "
                           f"{self.timeout_s:g} s (--grammar-compile-timeout)")
                    outcome = "timeout"
                else:
                    msg = (f"{c.where}: grammar backend {self.spec.backend} crashed compiling "
                           f"this {c.kind} constraint ({_exit(code)}); it is refused")
                    outcome = "crashed"
                log.warning("%s [%d characters]", msg, len(c.value))
                self._finish(job, outcome, GrammarError(msg))


def _exit(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return signal.Signals(-code).name
        except ValueError:
            return f"signal {-code}"
    return f"exit status {code}"


# -- the child ---------------------------------------------------------------------------------

def child_main(down_fd: int, up_fd: int) -> None:
    """Entry of a compile process (`python -m core.engine.grammar_compiler DOWN UP`, the pipes' file
    descriptors): build the backend as the worker does, then compile what the pipe sends, one
    at a time, until it closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the worker decides when children stop
    _die_with_parent()
    down, up = Connection(down_fd, writable=False), Connection(up_fd, readable=False)
    try:
        from core.contract.grammar import make_grammar
        from core.engine.loader import load_tokenizer
        from core.plan.args import make_server_args
        from core.plan.registry import get_registry

        spec = CompilerSpec(**json.loads(down.recv_bytes()))
        tok = load_tokenizer(make_server_args(**json.loads(spec.args_json)))
        grammar = make_grammar(get_registry(), spec.backend, tok, spec.vocab_size,
                               list(spec.stop_token_ids))
    except Exception as exc:  # noqa: BLE001 - sent to the worker, which refuses with it
        up.send_bytes(json.dumps({"ready": False,
                                  "error": f"{type(exc).__name__}: {exc}"}).encode())
        return
    serialize = grammar.caps.serialize
    _warm(grammar)
    up.send_bytes(b'{"ready": true}')
    while True:
        try:
            msg = json.loads(down.recv_bytes())
        except (EOFError, OSError):
            return
        t0 = time.perf_counter()
        reply: dict[str, object] = {"id": msg["id"]}  # sent as JSON
        try:
            c = Constraint(msg["kind"], msg["value"], msg["source"])
            compiled = grammar.compile(c)
            data = grammar.backend.serialize(compiled) if serialize else None
            reply.update(ok=True, data=None if data is None else
                         base64.b64encode(data).decode("ascii"))
        except ValueError as exc:  # GrammarError: 400, GrammarBackendError: 500
            reply.update(ok=False, error=str(exc), status=getattr(exc, "status", 400))
        except Exception as exc:  # noqa: BLE001 - the library's failure: 500
            reply.update(ok=False, status=500, error=f"grammar backend {spec.backend} failed: "
                                                     f"{type(exc).__name__}: {exc}")
        reply["seconds"] = time.perf_counter() - t0
        up.send_bytes(json.dumps(reply).encode())


def _warm(grammar: Grammar) -> None:
    """Compile one trivial constraint, so that the backend's per-vocabulary work (xgrammar's
    token tables, ~1-2 s) is done before the first request's deadline starts."""
    trivial = {"regex": "a", "json_object": "", "choice": '["a"]', "ebnf": 'root ::= "a"'}
    kind = next((k for k in trivial if k in grammar.caps.constraints), None)
    if kind is not None:
        try:
            grammar.compile(Constraint(kind, trivial[kind]))
        except Exception:  # noqa: BLE001 - a real constraint will say what is wrong
            pass


def _die_with_parent() -> None:
    """On Linux, have the kernel kill this process when the worker dies (a compile that hangs
    would otherwise outlive it); elsewhere the pipe's end stops it after the compile."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() == 1:  # the worker died before prctl took effect
        os._exit(0)


if __name__ == "__main__":
    child_main(int(sys.argv[1]), int(sys.argv[2]))
