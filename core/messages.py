"""The process boundary's vocabulary: frozen message dataclasses, sent as JSON over a pipe.

Every message is one UTF-8 JSON object (`encode`) sent with `Connection.send_bytes`; nothing is
pickled. One codec, driven by each dataclass's fields and their annotations, writes and reads
them all (`to_json` / `from_json`): a message is an object with its "type" and its fields (a
field whose default is None may be left out when None; every other one is required), a class
with `POSITIONAL` travels as the list of its field values (logprobs: compact; trailing fields
whose default is None are left out while None), a tuple as a list, a dict with int keys with
string keys. `decode` checks the shape (the type, every field's JSON type, no unknown field)
and returns the typed message, or raises ValueError naming what is wrong. Shape only: what a
request asks for is validated once, at the edge (core.frontend.request_checks), and the worker
trusts it.

The sampling parameters a request carries (`SamplingParams`, SGLang's names, validated where
they are built) are defined here too: the boundary's vocabulary imports no torch.

client -> worker: AddRequest, Abort, Rpc, Shutdown (rank 0 -> ranks also: GrammarReady,
                  PrefillBudget)
worker -> client: Ready (once, with EngineInfo), Fatal, StepOutput (once per step), Reply,
                  Heartbeat (every second, from a thread of the worker)
"""

from __future__ import annotations

import dataclasses
import json
import math
import types
import typing
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, fields
from multiprocessing.connection import Connection
from typing import Any, ClassVar, Literal, TypeVar

from core.contract.grammar import Constraint
from core.contract.json_types import JSON, JSONObject

T = TypeVar("T")

RPC_OPS = ("stats", "check_accounting", "flush_cache")
FINISH_TYPES = ("stop", "length", "abort")
RpcOp = Literal["stats", "check_accounting", "flush_cache", "load_lora", "unload_lora"]
FinishType = Literal["stop", "length", "abort"]


class ChannelClosed(EOFError):
    """The other end of the pipe is gone (process exited or closed its end)."""


# -- client -> worker ------------------------------------------------------------------------------

MAX_TOP_LOGPROBS = 20
LOGIT_BIAS_LIMIT = 100.0  # OpenAI: a bias is in [-100, 100]
MAX_LOGIT_BIAS = 1024  # entries per request (OpenAI caps it at 300 tokens; vLLM takes any)


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: no top-k
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    seed: int | None = None
    n: int = 1
    logprobs: bool = False
    top_logprobs: int = 0
    skip_special_tokens: bool = True
    # token id -> bias added to its logit before the draw (JSON keys arrive as strings)
    logit_bias: dict[int, float] = field(default_factory=dict)
    # None: off; k >= 0: each prompt token's logprob (after the first) and its k top alternatives
    prompt_logprobs: int | None = None
    # structured output: the grammar the output must follow (core.contract.grammar), or None
    constraint: Constraint | None = None

    def __post_init__(self) -> None:
        if isinstance(self.constraint, dict):  # from JSON (the wire, to_dict)
            self.constraint = Constraint.from_dict(self.constraint)
        if isinstance(self.logit_bias, dict) and any(isinstance(k, str)
                                                     for k in self.logit_bias):
            try:  # JSON object keys are strings: "50256" -> 50256
                self.logit_bias = {int(k): v for k, v in self.logit_bias.items()}
            except ValueError:
                raise ValueError(f"logit_bias keys must be token ids, got "
                                 f"{sorted(map(str, self.logit_bias))[:3]}") from None

    @classmethod
    def from_dict(cls, d: dict[str, object] | SamplingParams | None) -> SamplingParams:
        """Build from a request dict (or check an instance); unknown keys and bad values raise
        ValueError naming them."""
        if d is None:
            d = {}
        if isinstance(d, SamplingParams):
            d.validate()
            return d
        if not isinstance(d, dict):
            raise ValueError(f"sampling_params must be a dict, not {type(d).__name__}")
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"unknown sampling parameter(s): {', '.join(unknown)}")
        values = {k: v for k, v in d.items() if v is not None or k == "seed"}
        if isinstance(values.get("stop"), str):
            values["stop"] = [values["stop"]]
        p = cls(**values)
        p.validate()
        return p

    def to_dict(self) -> dict[str, Any]:  # asdict's: expand_n passes it back to the class
        return asdict(self)

    def validate(self) -> None:
        def integer(name: str, lo: int, hi: float = math.inf) -> None:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise ValueError(f"{name} must be an integer, got {v!r}")
            if not lo <= v <= hi:
                rng = f">= {lo}" if hi == math.inf else f"in [{lo}, {hi}]"
                raise ValueError(f"{name} must be {rng}, got {v}")

        def number(name: str, lo: float, hi: float, lo_open: bool = False) -> None:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise ValueError(f"{name} must be a number, got {v!r}")
            if math.isnan(v) or math.isinf(v):
                raise ValueError(f"{name} must be finite, got {v}")
            if v < lo or v > hi or (lo_open and v == lo):
                raise ValueError(f"{name} must be in {'(' if lo_open else '['}{lo}, {hi}], "
                                 f"got {v}")

        def boolean(name: str) -> None:
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")

        integer("max_new_tokens", 1)
        integer("min_new_tokens", 0, self.max_new_tokens)
        number("temperature", 0.0, 100.0)
        number("top_p", 0.0, 1.0, lo_open=True)
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or (
                self.top_k < 1 and self.top_k != -1):
            raise ValueError(f"top_k must be -1 (off) or a positive integer, got {self.top_k!r}")
        number("min_p", 0.0, 1.0)
        number("repetition_penalty", 0.0, 2.0, lo_open=True)
        number("frequency_penalty", -2.0, 2.0)
        number("presence_penalty", -2.0, 2.0)
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s
                                                      for s in self.stop):
            raise ValueError(f"stop must be a string or a list of non-empty strings, "
                             f"got {self.stop!r}")
        if not isinstance(self.stop_token_ids, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0
                for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be a list of token ids >= 0, "
                             f"got {self.stop_token_ids!r}")
        boolean("ignore_eos")
        if self.seed is not None:
            integer("seed", -(2**63), 2**63 - 1)  # any signed 64-bit integer
        integer("n", 1, 128)
        boolean("logprobs")
        integer("top_logprobs", 0, MAX_TOP_LOGPROBS)
        boolean("skip_special_tokens")
        if not isinstance(self.logit_bias, dict):
            raise ValueError(f"logit_bias must be an object of token id -> bias, "
                             f"got {type(self.logit_bias).__name__}")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias has {len(self.logit_bias)} entries; at most "
                             f"{MAX_LOGIT_BIAS} are allowed")
        for tok, bias in self.logit_bias.items():
            if isinstance(tok, bool) or not isinstance(tok, int) or tok < 0:
                raise ValueError(f"logit_bias keys must be token ids >= 0, got {tok!r}")
            if isinstance(bias, bool) or not isinstance(bias, (int, float)) or \
                    not -LOGIT_BIAS_LIMIT <= bias <= LOGIT_BIAS_LIMIT:
                raise ValueError(f"logit_bias[{tok}] must be a number in [-100, 100], "
                                 f"got {bias!r}")
        if self.prompt_logprobs is not None:
            integer("prompt_logprobs", 0, MAX_TOP_LOGPROBS)
        if self.constraint is not None:
            if not isinstance(self.constraint, Constraint):
                raise ValueError(f"constraint must be a core.contract.grammar.Constraint or its dict, "
                                 f"got {type(self.constraint).__name__}")
            self.constraint.validate()
            if self.min_new_tokens:
                # its mask would fight the grammar's where only a stop token may follow
                raise ValueError("min_new_tokens together with a structured-output constraint "
                                 "is not supported yet")

    def check_vocab(self, vocab_size: int) -> None:
        bad = [t for t in self.stop_token_ids if t >= vocab_size]
        if bad:
            raise ValueError(f"stop_token_ids {bad} are outside the vocabulary of {vocab_size}")
        bad = sorted(t for t in self.logit_bias if t >= vocab_size)
        if bad:
            raise ValueError(f"logit_bias keys {bad[:5]} are outside the vocabulary of "
                             f"{vocab_size}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


def expand_n(params: SamplingParams) -> list[SamplingParams]:
    """n > 1 becomes n requests of n = 1; with a seed, copy i draws with seed + i."""
    if params.n == 1:
        return [params]
    out = []
    for i in range(params.n):
        d = params.to_dict()
        d.update(n=1, seed=None if params.seed is None else params.seed + i)
        out.append(SamplingParams(**d))
    return out


@dataclass(frozen=True)
class AddRequest:
    """Queue a request; input ids and params were validated by the client."""

    TYPE: ClassVar[str] = "add"
    rid: str
    input_ids: tuple[int, ...]
    params: SamplingParams
    priority: int | None = None
    lora: str | None = None  # the LoRA adapter's name (None: the base model)


@dataclass(frozen=True)
class Abort:
    TYPE: ClassVar[str] = "abort"
    rid: str


@dataclass(frozen=True)
class Rpc:
    """A control call answered between steps by a Reply with the same id."""

    TYPE: ClassVar[str] = "rpc"
    id: int
    op: RpcOp
    # the op's arguments (load_lora: name and path; unload_lora: name); None for the others
    args: dict[str, str] | None = None


@dataclass(frozen=True)
class Shutdown:
    TYPE: ClassVar[str] = "shutdown"


@dataclass(frozen=True)
class GrammarReady:
    """Rank 0 to the other tensor-parallel ranks (inside a turn's broadcast, never from the
    client): these grammar compiles (the scheduler's ids) are done, so every rank moves their
    requests on at the same point of its schedule."""

    TYPE: ClassVar[str] = "grammar_ready"
    ids: tuple[int, ...]


@dataclass(frozen=True)
class PrefillBudget:
    """Rank 0 to the other tensor-parallel ranks (inside a turn's broadcast): the prefill
    budget its clock measured (core.engine.scheduler.budget; None: none), which every rank's
    steps use from this turn on, so all cut the same extends."""

    TYPE: ClassVar[str] = "prefill_budget"
    tokens: int | None = None


# -- worker -> client ------------------------------------------------------------------------------

@dataclass(frozen=True)
class EngineInfo:
    """What the client needs to know about the engine the worker built."""

    max_context: int
    pool_tokens: int
    page_size: int
    max_running_requests: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    chunked_prefill_size: int | None
    kv_bytes_per_token: int
    notes: tuple[str, ...]  # KV sizing, graph capture, overlap: found at startup
    cuda_graph_batch_sizes: tuple[int, ...]
    device: str
    pid: int
    # start-up of the engine process, phase by phase: (what was done, seconds)
    startup_phases: tuple[tuple[str, float], ...] = ()


@dataclass(frozen=True)
class Ready:
    TYPE: ClassVar[str] = "ready"
    info: EngineInfo


@dataclass(frozen=True)
class Fatal:
    """The worker is about to exit."""

    TYPE: ClassVar[str] = "fatal"
    error: str
    traceback: str = ""


@dataclass(frozen=True)
class TokenLogprob:
    """The chosen token's logprob and the top (token, logprob) pairs (-inf travels as
    -Infinity: both ends are Python's json); rank, where computed (prompt logprobs): how many
    tokens of the vocabulary are at least as likely as the chosen one (1: the most likely;
    vLLM's rank)."""

    POSITIONAL: ClassVar[bool] = True  # [logprob, [[token, logprob], ...]] or [..., rank]
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    rank: int | None = None


@dataclass(frozen=True)
class Finish:
    """Why a request finished: stop (matched: the stop string or token), length, or abort
    (message; status_code when rejected at admission)."""

    type: FinishType
    matched: str | int | None = None
    length: int | None = None
    message: str | None = None
    status_code: int | None = None


SPEC_FIELDS = ("spec_verify_ct", "spec_draft_tokens", "spec_accepted_tokens", "spec_note")


@dataclass(frozen=True)
class OutputItem:
    """One request's new tokens of a step (and their logprobs when asked for)."""

    rid: str
    ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] | None
    finish: Finish | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    # prompt_logprobs: one per prompt token after the first, on the request's first item only
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None
    # speculative decoding, on the last item (None while off): verify steps with drafts,
    # draft tokens, accepted ones; a note when speculation was off for this request
    spec_verify_ct: int | None = None
    spec_draft_tokens: int | None = None
    spec_accepted_tokens: int | None = None
    spec_note: str | None = None

    def __post_init__(self) -> None:
        if self.logprobs is not None and len(self.logprobs) != len(self.ids):
            raise ValueError(f"malformed output item: {len(self.logprobs)} logprobs for "
                             f"{len(self.ids)} tokens")
        if self.prompt_logprobs is not None and \
                len(self.prompt_logprobs) != max(self.prompt_tokens - 1, 0):
            raise ValueError(f"malformed output item: {len(self.prompt_logprobs)} prompt "
                             f"logprobs for {self.prompt_tokens} prompt tokens")


@dataclass(frozen=True)
class StepOutput:
    TYPE: ClassVar[str] = "out"
    items: tuple[OutputItem, ...]


@dataclass(frozen=True)
class Reply:
    """The answer to Rpc `id`: its result (JSON) when ok, else the error."""

    TYPE: ClassVar[str] = "reply"
    id: int
    ok: bool
    result: Any = None
    error: str | None = None


@dataclass(frozen=True)
class Heartbeat:
    """The worker is alive: the figures it published between its last steps, and how long the
    running step has taken (0 between steps)."""

    TYPE: ClassVar[str] = "heartbeat"
    stats: dict[str, Any] | None
    step_s: float


Message = (AddRequest | Abort | Rpc | Shutdown | GrammarReady | PrefillBudget | Ready | Fatal
           | StepOutput | Reply | Heartbeat)
MESSAGES: dict[str, type[Message]] = {
    m.TYPE: m for m in (AddRequest, Abort, Rpc, Shutdown, GrammarReady, PrefillBudget, Ready,
                        Fatal, StepOutput, Reply, Heartbeat)}
# how errors name a value of each class (messages: "<type> message")
_WHAT = {EngineInfo: "engine info", TokenLogprob: "logprob", Finish: "finish reason",
         OutputItem: "output item", SamplingParams: "sampling params", Constraint: "constraint"}


# -- the codec -------------------------------------------------------------------------------------

def to_json(value: object) -> JSON:
    """A message, or any value of a message's field, as JSON-able data."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _writer(type(value))(value)
    if isinstance(value, (tuple, list)):
        return [to_json(v) for v in value]
    if isinstance(value, dict):
        return {k if isinstance(k, str) else str(k): to_json(v) for k, v in value.items()}
    return value


# typed value (of the annotation the writer was built for) -> JSON value
Writer = Callable[[Any], JSON]
_WRITERS: dict[object, Writer] = {}  # annotation -> its writer
_SCALARS = (str, int, float, bool, type(None))


# An annotation (`tp`) is whatever typing accepts as a type: a class, `X | None`,
# `tuple[int, ...]`, `Literal[...]`; no static type names type forms.
def _writer(tp: Any) -> Writer:
    """The writer of a field annotation (or a dataclass), built once per annotation."""
    got = _WRITERS.get(tp)
    if got is None:
        got = _WRITERS[tp] = _build_writer(tp)
    return got


def _plain(tp: Any) -> bool:
    """Values of this annotation are JSON as they are."""
    if tp in _SCALARS or typing.get_origin(tp) is Literal:
        return True
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return all(_plain(a) for a in typing.get_args(tp))
    return False


def _identity(v: JSON) -> JSON:
    return v


def _build_writer(tp: Any) -> Writer:
    if _plain(tp):
        return _identity
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType) and type(None) in args:
        inner = _writer(typing.Union[tuple(a for a in args if a is not type(None))])
        return lambda v: None if v is None else inner(v)
    if origin in (tuple, list) and len(args) == 2 and args[1] is Ellipsis or origin is list:
        if _plain(args[0]):
            return list
        item = _writer(args[0])
        return lambda v: [item(x) for x in v]
    if origin is tuple:
        parts = [_writer(a) for a in args]
        return lambda v: [w(x) for w, x in zip(parts, v, strict=True)]
    if dataclasses.is_dataclass(tp):
        hints = typing.get_type_hints(tp)
        plan = [(f.name, _writer(hints[f.name]), f.default is None)
                for f in dataclasses.fields(tp)]
        if getattr(tp, "POSITIONAL", False):
            least = max((k + 1 for k, (_, _, optional) in enumerate(plan) if not optional),
                        default=0)
            if least == len(plan):
                return lambda v: [w(getattr(v, n)) for n, w, _ in plan]

            def shortest(v: object) -> list[JSON]:
                out = [w(getattr(v, n)) for n, w, _ in plan]
                while len(out) > least and out[-1] is None:
                    out.pop()
                return out
            return shortest
        return _compiled_writer(tp, plan)
    return to_json  # dict[...], Any: walked as it is


def _compiled_writer(tp: type, plan: list[tuple[str, Writer, bool]]) -> Writer:
    """The writer of a dataclass as one function made from its fields (no loop over them, no
    call for a plain field's value): what the worker runs on every item of every step. The
    same JSON as the plan says: "type" first, then each field in order, one whose default is
    None left out when None."""
    env: dict[str, object] = {"_identity": _identity}
    lines = ["def write(v):", "    out = {" + (f'"type": {tp.TYPE!r}' if hasattr(tp, "TYPE")
                                                else "") + "}"]
    for i, (name, w, optional) in enumerate(plan):
        if w is _identity:
            value = "x"
        elif w is list:
            value = "list(x)"
        else:
            env[f"w{i}"] = w
            value = f"w{i}(x)"
        lines.append(f"    x = v.{name}")
        if optional:
            lines.append(f"    if x is not None: out[{name!r}] = {value}")
        else:
            lines.append(f"    out[{name!r}] = {value}")
    lines.append("    return out")
    exec("\n".join(lines), env)  # noqa: S102 - source made here from field names only
    return env["write"]  # type: ignore[return-value]


# JSON value -> typed value (of the annotation the reader was built for); ValueError(what it
# must be)
Reader = Callable[[JSON], Any]


class _Bad(ValueError):
    """A value that is not what its annotation says (the message names the field)."""


def _is_int(v: object) -> bool:
    return type(v) is int


def _scalar(check: Callable[[JSON], bool], want: str,
            convert: Callable[[float], float] | None = None) -> tuple[Reader, str]:
    def read(v: JSON) -> JSON:
        if not check(v):
            raise _Bad(want)
        return v if convert is None else convert(v)
    return read, want


_READERS: dict[object, tuple[Reader, str]] = {}  # annotation -> its reader


def _reader(tp: Any) -> tuple[Reader, str]:
    """(read, description) for a field annotation, built once per annotation."""
    got = _READERS.get(tp)
    if got is None:
        got = _READERS[tp] = _build(tp)
    return got


def _build(tp: Any) -> tuple[Reader, str]:
    if tp is Any or tp is object:
        return (lambda v: v), "JSON"
    if tp is str:
        return _scalar(lambda v: type(v) is str, "a string")
    if tp is int:
        return _scalar(_is_int, "an integer")
    if tp is bool:
        return _scalar(lambda v: type(v) is bool, "true or false")
    if tp is float:
        return _scalar(lambda v: type(v) in (int, float), "a number", float)
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        allowed = frozenset(args)
        return _scalar(lambda v: type(v) is str and v in allowed,
                       f"one of {', '.join(map(str, args))}")
    if origin in (typing.Union, types.UnionType):
        if type(None) in args:  # X | None
            inner, want = _reader(typing.Union[tuple(a for a in args if a is not type(None))])
            return (lambda v: None if v is None else inner(v)), f"{want} or null"
        readers = [_reader(a) for a in args]

        def union(v: JSON) -> object:
            for read, _ in readers:
                try:
                    return read(v)
                except ValueError:
                    continue
            raise _Bad(" or ".join(w for _, w in readers))
        return union, " or ".join(w for _, w in readers)
    if origin in (tuple, list):
        if origin is tuple and not (len(args) == 2 and args[1] is Ellipsis):
            parts = [_reader(a) for a in args]
            want = f"a list of {len(parts)}"

            def fixed(v: JSON) -> tuple[object, ...]:
                if type(v) is not list or len(v) != len(parts):
                    raise _Bad(want)
                return tuple(r(x) for (r, _), x in zip(parts, v, strict=True))
            return fixed, want
        item, want = _reader(args[0])
        plural = {"an integer": "integers", "a string": "strings", "a number": "numbers"}
        want = f"a list of {plural.get(want, 'items')}"
        wrap = tuple if origin is tuple else list
        exact = {int: int, str: str, bool: bool}.get(args[0])
        if exact is not None:  # the common lists (token ids): one pass, no call per item
            def flat(v: JSON) -> Sequence[JSON]:
                if type(v) is not list or not all(type(x) is exact for x in v):
                    raise _Bad(want)
                return wrap(v)
            return flat, want

        def seq(v: JSON) -> Sequence[object]:
            if type(v) is not list:
                raise _Bad(want)
            try:
                return wrap([item(x) for x in v])
            except _Bad:
                raise _Bad(want) from None
        return seq, want
    if origin is dict:
        key, value = args
        keyed = int if key is int else None

        def mapping(v: JSON) -> JSONObject | dict[int, object]:
            if type(v) is not dict:
                raise _Bad("an object")
            if keyed is None:
                return v
            try:
                return {int(k): value_read(x) for k, x in v.items()}
            except ValueError:
                raise _Bad("an object of integer keys") from None
        value_read = _reader(value)[0]
        return mapping, "an object"
    if dataclasses.is_dataclass(tp):
        return _dataclass_reader(tp), "an object"
    raise TypeError(f"no JSON codec for {tp!r}")


def _dataclass_reader(cls: type) -> Reader:
    what = _WHAT.get(cls) or f"{cls.TYPE} message"
    hints = typing.get_type_hints(cls)
    fields = dataclasses.fields(cls)
    names = frozenset(f.name for f in fields) | ({"type"} if hasattr(cls, "TYPE") else set())
    required = [f.name for f in fields if f.default is not None]  # None-default: optional

    if getattr(cls, "POSITIONAL", False):
        plan = [(f.name, _reader(hints[f.name])) for f in fields]
        want = "[" + ", ".join(f.name for f in fields) + "]"
        # trailing fields whose default is None may be left out
        least = max((k + 1 for k, f in enumerate(fields) if f.default is not None), default=0)

        def positional(v: JSON) -> object:
            if type(v) is not list or not least <= len(v) <= len(plan):
                raise ValueError(f"malformed {what}: expected {want}, got {v!r:.80}")
            try:
                return cls(*(read(x) for (_, (read, _)), x in zip(plan[:len(v)], v,
                                                                    strict=True)))
            except _Bad:
                raise ValueError(f"malformed {what}: expected {want}, got {v!r:.80}") from None
        return positional

    # per field: (name, the exact type a plain field's value has (None: read it), may it be
    # null, reader, description); plain fields are checked inline (a 256-request step's items)
    checks = []
    for f in fields:
        tp = hints[f.name]
        args = typing.get_args(tp)
        nullable = typing.get_origin(tp) in (typing.Union, types.UnionType) and \
            type(None) in args and len(args) == 2
        base = next(a for a in args if a is not type(None)) if nullable else tp
        exact = base if base in (str, int, bool) else None
        checks.append((f.name, exact, nullable, *_reader(tp)))

    def read(d: JSON) -> object:
        if type(d) is not dict:
            raise ValueError(f"malformed {what}: expected an object, got {type(d).__name__}")
        if not d.keys() <= names:
            unknown = sorted(set(d) - names)
            raise ValueError(f"malformed {what}: unknown field(s) {', '.join(unknown)}")
        values = {}
        for name, kind, nullable, reader, want in checks:
            if name not in d:
                if name in required:
                    missing = [k for k in required if k not in d]  # in field order
                    raise ValueError(f"malformed {what}: missing field(s) "
                                     f"{', '.join(missing)}")
                continue
            x = d[name]
            if kind is not None and (type(x) is kind or nullable and x is None):
                values[name] = x
                continue
            try:
                values[name] = reader(x)
            except _Bad:
                raise ValueError(f"malformed {what}: {name} must be {want}, got "
                                 f"{x!r:.80}") from None
        return cls(**values)
    return _compiled_reader(cls, checks, read)


def _compiled_reader(cls: type, checks: list, slow: Reader) -> Reader:
    """The dict-form reader of `cls` as one function made from its fields: every field read,
    checked inline where its type is exact (str, int, bool, their `| None`, lists of them) and
    passed positionally; anything it does not take as it is (a wrong type, a missing or
    unknown field, a value a field's own reader refuses) goes to `slow`, the reader above,
    which returns the same value or raises the error that names the problem."""
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    optional = {f.name for f in dataclasses.fields(cls) if f.default is None}
    keys = frozenset(names) | ({"type"} if hasattr(cls, "TYPE") else set())
    env: dict[str, object] = {"cls": cls, "slow": slow, "keys": keys, "ValueError": ValueError}
    conds, args = [], []
    for i, (name, exact, nullable, reader, _) in enumerate(checks):
        x = f"x{i}"
        tp = hints[name]
        origin, targs = typing.get_origin(tp), typing.get_args(tp)
        item = targs[0] if origin in (tuple, list) and targs and (
            origin is list or len(targs) == 2 and targs[1] is Ellipsis) else None
        if exact is not None:
            t = f"type({x}) is {exact.__name__}"
            conds.append(f"({x} is None or {t})" if nullable else t)
            args.append(x)
        elif item in (int, str, bool):
            conds.append(f"type({x}) is list and all(type(t) is {item.__name__} for t in {x})")
            args.append(f"{'tuple' if origin is tuple else 'list'}({x})")
        else:
            env[f"r{i}"] = reader
            args.append(f"r{i}({x})")
    lines = ["def read(d):",
             "    if type(d) is not dict or not d.keys() <= keys:",
             "        return slow(d)"]
    for i, name in enumerate(names):
        if name in optional:
            lines.append(f"    x{i} = d.get({name!r})")
        else:
            lines += [f"    if {name!r} not in d:", "        return slow(d)",
                      f"    x{i} = d[{name!r}]"]
    if conds:
        lines += [f"    if not ({' and '.join(conds)}):", "        return slow(d)"]
    lines += ["    try:", f"        return cls({', '.join(args)})",
              "    except ValueError:", "        return slow(d)"]
    exec("\n".join(lines), env)  # noqa: S102 - source made here from field names only
    return env["read"]  # type: ignore[return-value]


def from_json(cls: type[T], value: JSON) -> T:
    """`value` (parsed JSON) as an instance of the dataclass `cls`; ValueError naming the
    problem."""
    return _reader(cls)[0](value)


def encode(msg: Message) -> bytes:
    return json.dumps(to_json(msg), separators=(",", ":")).encode()


def decode(data: bytes) -> Message:
    """The typed message in `data`; ValueError naming the problem when it is malformed."""
    try:
        obj = json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ValueError(f"malformed engine message: not JSON ({exc}): {data[:80]!r}") from None
    kind = obj.get("type") if isinstance(obj, dict) else None
    cls = MESSAGES.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise ValueError(f"malformed engine message: unknown or missing type {kind!r} "
                         f"(known: {', '.join(MESSAGES)}): {data[:80]!r}")
    return from_json(cls, obj)


class Channel:
    """One end of the pipe, speaking typed messages."""

    def __init__(self, conn: Connection):
        self.conn = conn

    def send(self, msg: Message) -> None:
        data = encode(msg)
        try:
            self.conn.send_bytes(data)
        except (OSError, ValueError) as exc:  # ValueError: the connection was closed here
            raise ChannelClosed(str(exc)) from exc

    def recv(self) -> Message:
        try:
            data = self.conn.recv_bytes()
        except (EOFError, OSError) as exc:
            raise ChannelClosed(str(exc)) from exc
        return decode(data)

    def poll(self, timeout: float | None) -> bool:
        try:
            return self.conn.poll(timeout)
        except (EOFError, OSError) as exc:
            raise ChannelClosed(str(exc)) from exc

    def close(self) -> None:
        self.conn.close()
