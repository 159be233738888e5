"""The grammar-backend protocol (structured output), as a plugin kind.

A grammar backend registers `register(name, GrammarCaps, factory)`; the resolver picks one
(`--grammar-backend`, the plan's `grammar_backend`; `none` turns structured output off). Each
process that needs it builds it once:

    backend = factory(tokenizer=core.tokenizer.Tokenizer, vocab_size=int, stop_token_ids=[int])

vocab_size is the model's logits width (it may exceed the tokenizer's); stop_token_ids end a
completed grammar. The backend implements GrammarBackend:

    validate(constraint)   check without the vocabulary; raises GrammarError naming the
                           problem (invalid JSON schema, invalid regex...). Run just before
                           compile, in the same place.
    compile(constraint)    -> compiled grammar for this vocabulary, immutable, shared by every
                           request with the same constraint (the core caches it); GrammarError.
                           The engine runs validate + compile in a child process with a
                           deadline (core.engine.grammar_compiler): a library that crashes or hangs on
                           client input costs that child, not the server. Elsewhere (tests,
                           the conformance suite) on a host thread: no parallel torch ops
                           (a second OpenMP team halves every later forward's speed on a CPU).
    serialize(compiled) -> bytes, deserialize(bytes) -> compiled   declared by
                           GrammarCaps.serialize: how the child's result comes back (on a host
                           thread of the worker). Without them the worker compiles again once
                           the child has shown that the constraint compiles safely.
    matcher(compiled)      -> a fresh GrammarMatcher for one sequence (n > 1: one each).

Before any of that, at the edge, the core checks a constraint's shape and size with no library
call (`Grammar.check`: core.contract.grammar_limits' bounds on size, nesting and count, then what the
backend's caps declare), so a known-hostile constraint is a 400 naming the limit.

A GrammarMatcher holds one sequence's position in its grammar:

    fill_bitmask(bitmask, row)  write the allowed next tokens into bitmask[row] (an int32 CPU
                                tensor [B, ceil(V / 32)]: bit j of word i allows token 32 i + j)
    accept(token) -> bool       advance past the sampled token (False: the grammar refuses it)
    is_terminated() -> bool     the grammar is complete and its stop token was accepted
    reset()                     back to the start (nothing accepted)
    close()                     free what it holds; the core calls it when the request finishes
                                or is aborted, and never uses the matcher again
    jump_forward() -> [int]     optional, declared by GrammarCaps.jump_forward: token ids the
                                grammar forces from here on (every completion the grammar
                                allows starts with their text), NOT accepted (the core accepts
                                each); [] when the next token is a choice, or the grammar is
                                complete. Without stop tokens. Need not be the tokenizer's own
                                split of the forced text, but must not end on a token that a
                                longer allowed token extends.

How the engine uses it: the client checks a request's Constraint (`Grammar.check`); the worker
takes a cached compile at admission, or parks the request while a compile process compiles it
(`Grammar.submit`; cached by backend + constraint), and keeps the matcher
with the request's sampling state; each step that samples a constrained request fills its row of
the bitmask, the sampler masks the logits (`apply_bitmask`) before drawing, the token is accepted,
and a terminated grammar finishes the request (finish_reason stop). A constrained request keeps its
matcher across retraction: its output is kept and recomputed, so the state stays true.

Jump-forward (--enable-jump-forward, a backend declaring it): after each sampled token the core
asks `jump_forward()`, accepts the forced tokens, appends them to the output (no logprobs: a
request asking for logprobs is never jumped) and computes them in one extend instead of one
decode step each, then samples the next free token (core.engine.scheduler).
"""

from __future__ import annotations

import functools
import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from core.contract.capabilities import CONSTRAINT_TYPES, GrammarCaps
from core.contract.grammar_limits import LimitError, check_limits, subschemas
from core.contract.json_types import JSON

if TYPE_CHECKING:  # the planner and the client import this module and no torch
    from collections.abc import Callable
    from concurrent.futures import Future, ThreadPoolExecutor

    import torch

    from core.plan.registry import Registry
    from core.tokenizer import Tokenizer

COMPILED_CACHE_SIZE = 256  # compiled grammars kept per process (LRU)


class GrammarError(ValueError):
    """A constraint that cannot be compiled or enforced; the message names the problem."""


class GrammarBackendError(GrammarError):
    """The backend itself failed on a constraint (its library raised something other than a
    refusal: a bug, or a version it was not written for). The request ends with a 500; the
    engine keeps serving the others."""

    status = 500


def _check_structural_tag(c: Constraint) -> None:
    """SGLang's / vLLM's structural tag: {"structures": [{"begin", "schema", "end"}, ...],
    "triggers": [...]}: outside a structure the text is free; a trigger opens one of the
    structures that begin with it, whose body follows its JSON schema, then its end."""
    where = c.where
    try:
        tag = c.parsed()
    except ValueError as exc:
        raise GrammarError(f"{where}: invalid structural tag: not JSON ({exc})") from None
    bad = None
    if not isinstance(tag, dict) or set(tag) != {"structures", "triggers"}:
        bad = "an object with exactly structures and triggers"
    elif not isinstance(tag["structures"], list) or not tag["structures"]:
        bad = "structures: a non-empty array"
    elif not all(isinstance(t, dict) and set(t) == {"begin", "schema", "end"}
                 and isinstance(t["begin"], str) and t["begin"] and isinstance(t["end"], str)
                 and isinstance(t["schema"], (dict, bool)) for t in tag["structures"]):
        bad = "each structure: {begin: non-empty string, schema: JSON schema, end: string}"
    elif not isinstance(tag["triggers"], list) or not tag["triggers"] or not all(
            isinstance(x, str) and x for x in tag["triggers"]):
        bad = "triggers: a non-empty array of non-empty strings"
    elif not all(any(t["begin"].startswith(x) for x in tag["triggers"])
                 for t in tag["structures"]):
        bad = "every structure's begin must start with one of the triggers"
    if bad:
        raise GrammarError(f"{where}: invalid structural tag: expected {bad}")


@dataclass(frozen=True)
class Constraint:
    """One request's structured-output constraint, as data (it crosses the process boundary).

    kind: one of CONSTRAINT_TYPES. value: the JSON schema as JSON text (json_schema), the regex,
    the EBNF grammar, the choices as a JSON array of strings (choice), the structural tag as JSON
    text; "" for json_object. source: the request field it came from, for messages only.
    """

    kind: str
    value: str = ""
    source: str = ""

    def key(self) -> tuple[str, str]:
        return (self.kind, self.value)

    @functools.cached_property
    def _json(self) -> tuple[JSON, Exception | None]:
        try:
            return json.loads(self.value), None
        except RecursionError:
            return None, LimitError(f"{self.where}: the JSON nests too deeply to parse")
        except ValueError as exc:
            return None, exc

    def parsed(self) -> JSON:
        """The value parsed as JSON, once for this constraint however often it is asked
        (ValueError when it is not JSON; LimitError when it nests deeper than the parser
        goes)."""
        value, error = self._json
        if error is not None:
            raise error
        return value

    @property
    def where(self) -> str:
        return self.source or self.kind

    def to_dict(self) -> dict[str, str]:
        return {"kind": self.kind, "value": self.value, "source": self.source}

    @classmethod
    def from_dict(cls, d: object) -> Constraint:
        if isinstance(d, Constraint):
            return d
        if not isinstance(d, dict) or set(d) - {"kind", "value", "source"} or "kind" not in d:
            raise ValueError(f"constraint must be an object with kind, value and source, "
                             f"got {d!r:.80}")
        c = cls(d["kind"], d.get("value", ""), d.get("source", ""))
        c.validate()
        return c

    def validate(self) -> None:
        """The shape of the value for its kind and its size within core.contract.grammar_limits (not
        whether a backend can compile it): bounded work, no grammar library called."""
        if self.kind not in CONSTRAINT_TYPES:
            raise ValueError(f"constraint kind must be one of {', '.join(CONSTRAINT_TYPES)}, "
                             f"got {self.kind!r:.40}")
        if not isinstance(self.value, str) or not isinstance(self.source, str):
            raise ValueError("constraint value and source must be strings")
        try:
            check_limits(self.kind, self.value, self.where, parse=self.parsed)
        except LimitError as exc:
            raise GrammarError(str(exc)) from None
        if self.kind == "structural_tag":
            _check_structural_tag(self)
        elif self.kind == "json_schema":
            try:
                v = self.parsed()
            except ValueError as exc:
                raise GrammarError(f"{self.where}: invalid JSON schema: not JSON ({exc})") \
                    from None
            if not isinstance(v, (dict, bool)):
                raise GrammarError(f"{self.where}: invalid JSON schema: a schema is an object "
                                   f"or a boolean, got {type(v).__name__}")
        elif self.kind == "choice":
            v = self.parsed() if self.value.startswith("[") else None
            if not (isinstance(v, list) and v and all(isinstance(x, str) and x for x in v)):
                raise GrammarError(f"{self.where}: choices must be a non-empty array of "
                                   f"non-empty strings")
        elif self.kind in ("regex", "ebnf") and not self.value:
            raise GrammarError(f"{self.where}: the {self.kind} is empty")

    def schema(self) -> JSON:
        """The JSON schema (json_schema constraints; else None): parsed once and shared, so
        read it, do not modify it."""
        return self.parsed() if self.kind == "json_schema" else None

    def choices(self) -> list[str]:
        """The choices (choice constraints; else []): shared like schema()."""
        return self.parsed() if self.kind == "choice" else []


@runtime_checkable
class GrammarMatcher(Protocol):
    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None: ...

    def accept(self, token: int) -> bool: ...

    def is_terminated(self) -> bool: ...

    def reset(self) -> None: ...

    def close(self) -> None: ...


MAX_JUMP_TOKENS = 256  # forced tokens appended at once (the rest after the next extend)


def forced_tokens(matcher: GrammarMatcher, limit: int) -> list[int]:
    """The tokens `matcher` forces next (at most `limit`), accepted into it; [] for a matcher
    without jump-forward. Stops at a token the matcher refuses (a backend bug: the rest is
    not forced after all)."""
    jump = getattr(matcher, "jump_forward", None)
    if jump is None or limit <= 0:
        return []
    out = []
    for tok in jump()[:min(limit, MAX_JUMP_TOKENS)]:
        if not matcher.accept(int(tok)):
            break
        out.append(int(tok))
    return out


@runtime_checkable
class GrammarBackend(Protocol):
    def validate(self, constraint: Constraint) -> None: ...

    # the compiled grammar is the backend's own type (core keeps it opaque: `object` below)
    def compile(self, constraint: Constraint) -> Any: ...

    def matcher(self, compiled: Any) -> GrammarMatcher: ...


class GrammarCompiler(Protocol):
    """What `Grammar.compiler` is: the engine's compile processes
    (core.engine.grammar_compiler.CompileService)."""

    def submit(self, c: Constraint) -> Future[object]: ...

    def cancel(self, fut: Future[object]) -> None: ...

    def stats(self) -> dict[str, int | float]: ...

    def close(self) -> None: ...


def schema_keywords(schema: JSON) -> set[str]:
    """The keywords a JSON schema uses anywhere (property names are not keywords)."""
    seen: set[str] = set()

    def walk(s: JSON) -> None:
        if not isinstance(s, dict):
            return
        seen.update(k for k in s if isinstance(k, str))
        for x in subschemas(s):
            walk(x)

    walk(schema)
    return seen


def check_constraint(c: Constraint, name: str, caps: GrammarCaps) -> None:
    """Raise GrammarError when grammar backend `name` cannot enforce `c`, as far as its
    shape, the limits (core.contract.grammar_limits) and the backend's declared caps tell: bounded
    work that calls no grammar library, so the edge runs it on any thread. What only the
    library knows (an invalid regex) is found when the constraint compiles."""
    c.validate()
    if c.kind not in caps.constraints:
        supported = ", ".join(k for k in CONSTRAINT_TYPES if k in caps.constraints)
        raise GrammarError(f"{c.where}: grammar backend {name} does not support "
                           f"{c.kind} constraints (supports {supported})")
    if c.kind == "json_schema":
        lacking = sorted(schema_keywords(c.schema()) & caps.schema_lacks)
        if lacking:
            raise GrammarError(f"{c.where}: the JSON schema uses {', '.join(lacking)}, which "
                               f"grammar backend {name} cannot enforce")


class Grammar:
    """The chosen backend in one process: checks against its caps, compiled-grammar cache.

    backend: the GrammarBackend, or None with `build` (a no-argument factory): then it is built
    on first use, or on the compile thread by `prepare()` (its library's import, ~1 s for
    xgrammar with transformers, stays off the engine's start)."""

    def __init__(self, name: str, caps: GrammarCaps, backend: GrammarBackend | None,
                 vocab_size: int, cache_size: int = COMPILED_CACHE_SIZE,
                 build: Callable[[], GrammarBackend] | None = None):
        if backend is None and build is None:
            raise ValueError("Grammar needs a backend or a build function")
        self.name, self.caps = name, caps
        self._backend, self._build = backend, build
        self._building: Future[GrammarBackend] | None = None  # prepare()'s future
        self._build_lock = threading.Lock()
        self.vocab_size = vocab_size
        self._cache: OrderedDict[tuple[str, str, str], object] = OrderedDict()
        self._cache_size = cache_size
        self.compiled = 0  # cache misses (tests and stats)
        # the compile thread (submit), made on first use
        self._pool: ThreadPoolExecutor | None = None
        # the engine's compile processes (core.engine.grammar_compiler.CompileService); None: compiles
        # run on a thread of this process (tests, the conformance suite)
        self.compiler: GrammarCompiler | None = None

    @property
    def backend(self) -> GrammarBackend:
        """The backend, built now if nothing built it yet (waits for prepare()'s build). A
        build that fails (its library broken) is a GrammarBackendError: the constrained
        request gets a 500 and the engine goes on serving the others."""
        if self._backend is None:
            with self._build_lock:
                if self._backend is None:
                    try:
                        self._backend = self._build()
                    except Exception as exc:  # noqa: BLE001 - the library's, not the request's
                        raise GrammarBackendError(
                            f"grammar backend {self.name} could not be built: "
                            f"{type(exc).__name__}: {exc}") from exc
        return self._backend

    def prepare(self) -> None:
        """Build the backend on a host thread, in the background (compiles submitted after it
        queue behind it); a no-op when it is built."""
        if self._backend is None and self._building is None:
            self._building = self._thread().submit(lambda: self.backend)

    def check(self, c: Constraint) -> None:
        """Raise GrammarError when this backend cannot enforce `c` (never run it loosely): the
        edge's checks (`check_constraint`), then the backend's own validate, which calls its
        library (in this process: tests and the conformance suite; the engine leaves that to
        its compile processes)."""
        check_constraint(c, self.name, self.caps)
        self.backend.validate(c)

    def cached(self, c: Constraint) -> object | None:
        """The compiled grammar of `c` if the cache holds it (marked recently used), else None."""
        key = (self.name, *c.key())
        got = self._cache.get(key)
        if got is not None:
            self._cache.move_to_end(key)
        return got

    def compile(self, c: Constraint) -> object:
        """Validate and compile `c`, which `check` passed (no cache; safe on another thread: it
        touches no state here). GrammarError for a refusal; GrammarBackendError when the
        library itself fails; a grammar that allows no token at its start (`root ::= root`)
        is a GrammarError too, as it could never finish. The engine runs this in a child
        process with a deadline (core.engine.grammar_compiler): a library that crashes or hangs
        on client input costs only that child."""
        try:
            self.backend.validate(c)
            compiled = self.backend.compile(c)
            startable = self._allows_a_first_token(compiled)
        except ValueError:
            raise
        except Exception as exc:  # noqa: BLE001 - the library's failure, not the request's
            raise GrammarBackendError(f"grammar backend {self.name} failed to compile the "
                                      f"{c.where} constraint: {type(exc).__name__}: "
                                      f"{exc}") from exc
        if not startable:
            raise GrammarError(f"{c.where}: the constraint can never be satisfied: its grammar "
                               "allows no token, not even an end, at its start (a rule defined "
                               "only by itself, such as `root ::= root`, or text no token of "
                               "this model can write)")
        return compiled

    def _allows_a_first_token(self, compiled: object) -> bool:
        """Whether a fresh matcher allows any token (a stop token included): a grammar that
        allows none could never produce or finish an answer (one mask, plain Python over a
        small tensor: no parallel torch op on this thread)."""
        import torch

        m = self.backend.matcher(compiled)
        try:
            bitmask = torch.zeros((1, -(-self.vocab_size // 32)), dtype=torch.int32)
            m.fill_bitmask(bitmask, 0)
            return any(bitmask[0].tolist())
        finally:
            m.close()

    def store(self, c: Constraint, compiled: object) -> None:
        """Keep a compiled grammar (least recently used out first)."""
        self.compiled += 1
        self._cache[(self.name, *c.key())] = compiled
        if len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)

    def submit(self, c: Constraint) -> Future[object]:
        """Compile `c` (which `check` passed) in a compile process (`compiler`), else on the
        grammar's host thread; a concurrent.futures.Future of the compiled grammar (the caller
        stores it: the cache is the scheduler thread's)."""
        if self.compiler is not None:
            return self.compiler.submit(c)
        return self._thread().submit(self.compile, c)

    def cancel(self, fut: Future[object]) -> None:
        """No request waits for this compile any more: stop it (its process is killed), or
        drop it if it has not started."""
        if self.compiler is not None:
            self.compiler.cancel(fut)
        else:
            fut.cancel()

    def stats(self) -> dict[str, int | float]:
        """The compile processes' counts (core.engine.grammar_compiler), {} without them."""
        return self.compiler.stats() if self.compiler is not None else {}

    def close(self) -> None:
        """Stop the compile processes and threads (the engine is closing)."""
        if self.compiler is not None:
            self.compiler.close()
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    def _thread(self) -> ThreadPoolExecutor:
        if self._pool is None:
            from concurrent.futures import ThreadPoolExecutor

            self._pool = ThreadPoolExecutor(1, thread_name_prefix="core-grammar-compile")
        return self._pool

    def compiled_for(self, c: Constraint) -> object:
        """The compiled grammar of `c`: cached, or compiled now and stored."""
        got = self.cached(c)
        if got is None:
            check_constraint(c, self.name, self.caps)
            got = self.compile(c)
            self.store(c, got)
        return got

    def matcher_of(self, compiled: object) -> GrammarMatcher:
        """A fresh matcher for one sequence over a compiled grammar."""
        return self.backend.matcher(compiled)

    def matcher(self, c: Constraint) -> GrammarMatcher:
        """A fresh matcher for one sequence (compiles on a cache miss; GrammarError)."""
        return self.backend.matcher(self.compiled_for(c))


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int],
                  to_device: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
    """logits[rows[i]] = -inf where bitmask[i] forbids the token (plain PyTorch, any device).

    logits [B, V]; bitmask [len(rows), ceil(V / 32)] int32 (bit j of word w: token 32 w + j).
    to_device(host tensor) -> the same on logits' device: the Platform's copy (pinned on a
    GPU, so the host does not wait for the queued forward); default: a plain `.to`.
    """
    import torch

    move = to_device or (lambda t: t.to(logits.device, non_blocking=True))
    V = logits.shape[1]
    words = bitmask if bitmask.device == logits.device else move(bitmask)
    shifts = torch.arange(32, device=logits.device, dtype=torch.int32)
    allowed = ((words[:, :, None] >> shifts) & 1).bool()  # [b, W, 32]
    allowed = allowed.reshape(len(rows), -1)[:, :V]  # [b, V]
    if len(rows) == logits.shape[0] and rows == list(range(len(rows))):  # every row
        logits.masked_fill_(~allowed, float("-inf"))
        return
    idx = move(torch.tensor(rows))
    logits[idx] = logits[idx].masked_fill(~allowed, float("-inf"))


def make_grammar(registry: Registry, name: str | None, tokenizer: Tokenizer, vocab_size: int,
                 stop_token_ids: list[int], lazy: bool = False) -> Grammar | None:
    """The plan's grammar backend, None when off. lazy: built on first use or by prepare()
    (its library imported then); else built, and its library imported, here."""
    if name is None:
        return None
    reg = registry.get("grammar", name)
    if reg is None:
        raise ValueError(f"grammar backend {name!r} is not registered in this process")

    def build() -> GrammarBackend:
        return reg.load()(tokenizer=tokenizer, vocab_size=vocab_size,
                          stop_token_ids=list(stop_token_ids))

    if lazy:
        return Grammar(name, reg.caps, None, vocab_size, build=build)
    return Grammar(name, reg.caps, build(), vocab_size)
