"""The process boundary's vocabulary: frozen message dataclasses, sent as JSON over a pipe.

Every message is one UTF-8 JSON object (`encode`) sent with `Connection.send_bytes`; nothing is
pickled. `decode` checks the object's shape (its "type", every field's JSON type) and returns the
typed message, or raises ValueError naming what is wrong. Shape only: what a request asks for is
validated once, at the edge (core.frontend.client.EngineClient.prepare), and the worker trusts it.

client -> worker: AddRequest, Abort, Rpc, Shutdown (rank 0 -> ranks also: GrammarReady)
worker -> client: Ready (once, with EngineInfo), Fatal, StepOutput (once per step), Reply,
                  Heartbeat (every second, from a thread of the worker)
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, ClassVar

from core.engine.sampling import SamplingParams
from core.json_shape import fields as _fields
from core.json_shape import is_int as _is_int
from core.json_shape import is_num as _is_num
from core.json_shape import list_of as _list_of
from core.json_shape import of_type as _of
from core.json_shape import optional as _opt

RPC_OPS = ("stats", "check_accounting", "flush_cache")
FINISH_TYPES = ("stop", "length", "abort")


class ChannelClosed(EOFError):
    """The other end of the pipe is gone (process exited or closed its end)."""


# -- shape checks (core.json_shape) ----------------------------------------------------------------

_PARAM_CHECKS = {"int": (_is_int, "an integer"), "float": (_is_num, "a number"),
                 "bool": (_of(bool), "true or false"), "int | None": (_opt(_is_int), "an integer"),
                 "list[str]": (_list_of(_of(str)), "a list of strings"),
                 "list[int]": (_list_of(_is_int), "a list of integers"),
                 "Constraint | None": (_opt(_of(dict)), "an object or null"),
                 "dict[int, float]": (_of(dict), "an object")}
_PARAMS = {f.name: _PARAM_CHECKS[str(f.type)] for f in dataclasses.fields(SamplingParams)}


def _params(d: Any) -> SamplingParams:
    # Built without validate(): the client validated them; this only checks the shape (a
    # constraint's too: Constraint.from_dict).
    return SamplingParams(**_fields(d, "sampling params", _PARAMS))


class _Flat:
    """to_dict for a message whose fields are JSON values as they are."""

    TYPE: ClassVar[str]

    def to_dict(self) -> dict[str, Any]:
        return {"type": self.TYPE, **{f.name: getattr(self, f.name)
                                      for f in dataclasses.fields(self)}}  # type: ignore[arg-type]


# -- client -> worker ------------------------------------------------------------------------------

@dataclass(frozen=True)
class AddRequest:
    """Queue a request; input ids and params were validated by the client."""

    TYPE: ClassVar[str] = "add"
    rid: str
    input_ids: tuple[int, ...]
    params: SamplingParams
    priority: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"type": self.TYPE, "rid": self.rid, "input_ids": list(self.input_ids),
                "params": self.params.to_dict(), "priority": self.priority}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> AddRequest:
        f = _fields(d, "add message", {"rid": (_of(str), "a string"),
                                       "input_ids": (_list_of(_is_int), "a list of integers"),
                                       "params": (_of(dict), "an object"),
                                       "priority": (_opt(_is_int), "an integer or null")})
        return cls(f["rid"], tuple(f["input_ids"]), _params(f["params"]), f["priority"])


@dataclass(frozen=True)
class Abort(_Flat):
    TYPE: ClassVar[str] = "abort"
    rid: str

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Abort:
        return cls(**_fields(d, "abort message", {"rid": (_of(str), "a string")}))


@dataclass(frozen=True)
class Rpc(_Flat):
    """A control call answered between steps by a Reply with the same id."""

    TYPE: ClassVar[str] = "rpc"
    id: int
    op: str  # one of RPC_OPS

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Rpc:
        return cls(**_fields(d, "rpc message", {
            "id": (_is_int, "an integer"),
            "op": (lambda v: v in RPC_OPS, f"one of {', '.join(RPC_OPS)}")}))


@dataclass(frozen=True)
class Shutdown(_Flat):
    TYPE: ClassVar[str] = "shutdown"

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Shutdown:
        _fields(d, "shutdown message", {})
        return cls()


@dataclass(frozen=True)
class GrammarReady(_Flat):
    """Rank 0 to the other tensor-parallel ranks (inside a turn's broadcast, never from the
    client): these grammar compiles (the scheduler's ids) are done, so every rank moves their
    requests on at the same point of its schedule."""

    TYPE: ClassVar[str] = "grammar_ready"
    ids: tuple[int, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"type": self.TYPE, "ids": list(self.ids)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> GrammarReady:
        got = _fields(d, "grammar_ready message", {
            "ids": (_list_of(_is_int), "a list of integers")})
        return cls(tuple(got["ids"]))


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

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        for key in ("eos_token_ids", "notes", "cuda_graph_batch_sizes"):
            d[key] = list(d[key])
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> EngineInfo:
        f = _fields(d, "engine info", {
            **{k: (_is_int, "an integer") for k in ("max_context", "pool_tokens", "page_size",
                                                     "max_running_requests", "vocab_size",
                                                     "kv_bytes_per_token", "pid")},
            "eos_token_ids": (_list_of(_is_int), "a list of integers"),
            "chunked_prefill_size": (_opt(_is_int), "an integer or null"),
            "notes": (_list_of(_of(str)), "a list of strings"),
            "cuda_graph_batch_sizes": (_list_of(_is_int), "a list of integers"),
            "device": (_of(str), "a string")})
        for key in ("eos_token_ids", "notes", "cuda_graph_batch_sizes"):
            f[key] = tuple(f[key])
        return cls(**f)


@dataclass(frozen=True)
class Ready:
    TYPE: ClassVar[str] = "ready"
    info: EngineInfo

    def to_dict(self) -> dict[str, Any]:
        return {"type": self.TYPE, "info": self.info.to_dict()}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Ready:
        f = _fields(d, "ready message", {"info": (_of(dict), "an object")})
        return cls(EngineInfo.from_dict(f["info"]))


@dataclass(frozen=True)
class Fatal(_Flat):
    """The worker is about to exit."""

    TYPE: ClassVar[str] = "fatal"
    error: str
    traceback: str = ""

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Fatal:
        return cls(**_fields(d, "fatal message", {"error": (_of(str), "a string"),
                                                  "traceback": (_of(str), "a string")}))


@dataclass(frozen=True)
class TokenLogprob:
    """The chosen token's logprob and the top (token, logprob) pairs (-inf travels as
    -Infinity: both ends are Python's json)."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()

    def to_list(self) -> list[Any]:
        return [self.logprob, [list(t) for t in self.top]]

    @classmethod
    def from_list(cls, v: Any) -> TokenLogprob:
        pair = lambda t: isinstance(t, list) and len(t) == 2 and _is_int(t[0]) and _is_num(t[1])  # noqa: E731
        if not (isinstance(v, list) and len(v) == 2 and _is_num(v[0])
                and _list_of(pair)(v[1])):
            raise ValueError(f"malformed logprob: expected [logprob, [[token, logprob], ...]], "
                             f"got {v!r:.80}")
        return cls(float(v[0]), tuple((int(t), float(lp)) for t, lp in v[1]))


@dataclass(frozen=True)
class Finish:
    """Why a request finished: stop (matched: the stop string or token), length, or abort
    (message; status_code when rejected at admission)."""

    type: str  # one of FINISH_TYPES
    matched: str | int | None = None
    length: int | None = None
    message: str | None = None
    status_code: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}

    @classmethod
    def from_dict(cls, d: Any) -> Finish:
        return cls(**_fields(d, "finish reason", {
            "type": (lambda v: v in FINISH_TYPES, f"one of {', '.join(FINISH_TYPES)}"),
            "matched": (lambda v: isinstance(v, str) or _is_int(v), "a string or token id"),
            "length": (_is_int, "an integer"), "message": (_of(str), "a string"),
            "status_code": (_is_int, "an integer")},
            optional=("matched", "length", "message", "status_code")))


_ITEM_KEYS = frozenset(("rid", "ids", "lps", "finish", "prompt_tokens", "completion_tokens",
                        "cached_tokens"))


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

    def to_dict(self) -> dict[str, Any]:
        d = {"rid": self.rid, "ids": list(self.ids),
             "lps": None if self.logprobs is None else [x.to_list() for x in self.logprobs],
             "finish": None if self.finish is None else self.finish.to_dict(),
             "prompt_tokens": self.prompt_tokens,
             "completion_tokens": self.completion_tokens, "cached_tokens": self.cached_tokens}
        if self.prompt_logprobs is not None:  # absent otherwise: from_dict's fast path
            d["plps"] = [x.to_list() for x in self.prompt_logprobs]
        return d

    @classmethod
    def from_dict(cls, d: Any) -> OutputItem:
        # The common item (no logprobs) checked inline: a 256-request step decodes in a fifth
        # of the time; anything else takes the general check, which names what is wrong.
        if (type(d) is dict and d.keys() == _ITEM_KEYS and d["lps"] is None
                and type(d["rid"]) is str and type(d["ids"]) is list
                and all(type(t) is int for t in d["ids"])
                and type(d["prompt_tokens"]) is int and type(d["completion_tokens"]) is int
                and type(d["cached_tokens"]) is int
                and (d["finish"] is None or type(d["finish"]) is dict)):
            fin = d["finish"]
            return cls(d["rid"], tuple(d["ids"]), None,
                       None if fin is None else Finish.from_dict(fin), d["prompt_tokens"],
                       d["completion_tokens"], d["cached_tokens"])
        f = _fields(d, "output item", {
            "rid": (_of(str), "a string"), "ids": (_list_of(_is_int), "a list of integers"),
            "lps": (_opt(lambda v: isinstance(v, list)), "a list or null"),
            "finish": (_opt(_of(dict)), "an object or null"),
            **{k: (_is_int, "an integer") for k in ("prompt_tokens", "completion_tokens",
                                                     "cached_tokens")},
            "plps": (lambda v: isinstance(v, list), "a list")}, optional=("plps",))
        lps = None if f["lps"] is None else tuple(TokenLogprob.from_list(x) for x in f["lps"])
        if lps is not None and len(lps) != len(f["ids"]):
            raise ValueError(f"malformed output item: {len(lps)} logprobs for "
                             f"{len(f['ids'])} tokens")
        plps = None
        if "plps" in f:
            plps = tuple(TokenLogprob.from_list(x) for x in f["plps"])
            if len(plps) != max(f["prompt_tokens"] - 1, 0):
                raise ValueError(f"malformed output item: {len(plps)} prompt logprobs for "
                                 f"{f['prompt_tokens']} prompt tokens")
        return cls(f["rid"], tuple(f["ids"]), lps,
                   None if f["finish"] is None else Finish.from_dict(f["finish"]),
                   f["prompt_tokens"], f["completion_tokens"], f["cached_tokens"], plps)


@dataclass(frozen=True)
class StepOutput:
    TYPE: ClassVar[str] = "out"
    items: tuple[OutputItem, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"type": self.TYPE, "items": [i.to_dict() for i in self.items]}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> StepOutput:
        f = _fields(d, "out message", {"items": (_of(list), "a list")})
        return cls(tuple(OutputItem.from_dict(i) for i in f["items"]))


@dataclass(frozen=True)
class Reply(_Flat):
    """The answer to Rpc `id`: its result (JSON) when ok, else the error."""

    TYPE: ClassVar[str] = "reply"
    id: int
    ok: bool
    result: Any = None
    error: str | None = None

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Reply:
        return cls(**_fields(d, "reply message", {
            "id": (_is_int, "an integer"), "ok": (_of(bool), "true or false"),
            "result": (_of(object), "JSON"), "error": (_opt(_of(str)), "a string or null")},
            optional=("result", "error")))


@dataclass(frozen=True)
class Heartbeat(_Flat):
    """The worker is alive: the figures it published between its last steps, and how long the
    running step has taken (0 between steps)."""

    TYPE: ClassVar[str] = "heartbeat"
    stats: dict[str, Any] | None
    step_s: float

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Heartbeat:
        return cls(**_fields(d, "heartbeat message", {
            "stats": (_opt(_of(dict)), "an object or null"), "step_s": (_is_num, "a number")}))


Message = (AddRequest | Abort | Rpc | Shutdown | GrammarReady | Ready | Fatal | StepOutput | Reply
           | Heartbeat)
MESSAGES: dict[str, Any] = {m.TYPE: m for m in (AddRequest, Abort, Rpc, Shutdown, GrammarReady,
                                                Ready, Fatal, StepOutput, Reply, Heartbeat)}


def encode(msg: Message) -> bytes:
    return json.dumps(msg.to_dict(), separators=(",", ":")).encode()


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
    return cls.from_dict(obj)


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
