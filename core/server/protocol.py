"""Request parsing: JSON bodies of the three generation routes into one `ParsedRequest`.

Everything here is cheap and runs before tokenizing: types, finiteness, ranges and the caps on n,
logprobs, stop strings and max_tokens. Every rejection is an `APIError` 400 naming the parameter.
Sampling parameters are translated to SGLang's names (max_tokens -> max_new_tokens, ...).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypedDict

from core.server.errors import APIError, invalid
from core.server.structured import NATIVE_FIELDS, OPENAI_FIELDS, constraint_of
from core.server.tools import (
    MessageToolFields,
    ToolRequest,
    check_with_constraint,
    message_fields,
    name_tool_results,
    parse_tools,
)

if TYPE_CHECKING:
    from core.contract.json_types import JSON, JSONObject

MAX_N = 16  # choices per prompt
MAX_SEQUENCES = 64  # prompts x n in one request
MAX_LOGPROBS = 20  # alternatives per token (OpenAI's cap)
MAX_STOP = 16  # stop strings
MAX_STOP_CHARS = 256  # characters in one stop string
MAX_STOP_TOKEN_IDS = 64
MAX_LOGIT_BIAS = 1024  # entries (core.engine.sampling's cap)
MAX_MESSAGES = 4096
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1  # any signed 64-bit integer (vLLM's range)
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")

# OpenAI's documented ranges (enforced on the OpenAI routes; /generate leaves them to the engine)
OPENAI_RANGES = {"temperature": (0.0, 2.0), "top_p": (0.0, 1.0),
                 "frequency_penalty": (-2.0, 2.0), "presence_penalty": (-2.0, 2.0)}

# SGLang sampling_params accepted by /generate
NATIVE_SAMPLING_KEYS = ("max_new_tokens", "min_new_tokens", "temperature", "top_p", "top_k",
                        "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty",
                        "stop", "stop_token_ids", "ignore_eos", "skip_special_tokens", "n", "seed",
                        "sampling_seed", "logit_bias", *NATIVE_FIELDS)


class _ChatMessageBase(TypedDict):
    role: str  # one of CHAT_ROLES, developer turned into system
    content: str


class ChatMessage(_ChatMessageBase, MessageToolFields, total=False):
    """One checked chat message (`_messages`), in the shape chat templates take."""

    name: str
    reasoning_content: str  # an assistant turn's reasoning, replayed


@dataclass
class Prompt:
    """One prompt as given: exactly one of text, ids, messages is set."""

    text: str | None = None
    ids: list[int] | None = None
    messages: list[ChatMessage] | None = None


@dataclass
class ParsedRequest:
    route: str  # completions | chat | generate
    prompts: list[Prompt]
    n: int = 1
    stream: bool = False
    sampling: dict[str, Any] = field(default_factory=dict)  # SGLang names; no max_new_tokens
    max_new_tokens: int | None = None  # None: the route's default, fitted to the context
    logprobs: bool = False
    top_logprobs: int = 0
    echo: bool = False
    include_usage: bool = False
    model: str | None = None
    batch: bool = False  # /generate with a list: answer a list
    add_generation_prompt: bool = True
    rid: str | None = None
    # prompt logprobs: None off; k: each prompt token's (after the first) and k alternatives
    # (vLLM's prompt_logprobs, completions' echo with logprobs, /generate's logprob_start_len)
    prompt_logprobs: int | None = None
    logprob_start_len: int = -1  # /generate: prompt position its input logprobs start at
    return_token_ids: bool = False  # vLLM: prompt_token_ids / token_ids in the response
    tools: ToolRequest | None = None  # chat: the tool fields, None without tools
    # chat's reasoning fields (core.server.reasoning): as given (None: not given)
    separate_reasoning: bool | None = None
    stream_reasoning: bool | None = None
    chat_template_kwargs: dict[str, JSON] = field(default_factory=dict)
    split_reasoning: bool = False  # decided by the server (ServerChatOptions.prepare)
    # the LoRA adapter of each prompt (None: the base model): /generate's lora_path, or the
    # adapter OpenAI's `model` names (set by the server, which knows the adapters)
    loras: list[str | None] | None = None


def parse_json_body(raw: bytes) -> JSONObject:
    """Bytes -> JSON object; malformed, non-UTF-8, too deep or non-object bodies are 400."""
    try:
        body = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise APIError(400, f"request body is not valid UTF-8: {e.reason} at byte {e.start}",
                       code="invalid_json") from None
    except json.JSONDecodeError as e:
        raise APIError(400, f"request body is not valid JSON: {e.msg} (line {e.lineno}, "
                       f"column {e.colno})", code="invalid_json") from None
    except (ValueError, RecursionError) as e:  # 5000-digit integers, nesting beyond the stack
        raise APIError(400, f"request body is not acceptable JSON: {type(e).__name__}: {e}"[:300],
                       code="invalid_json") from None
    if not isinstance(body, dict):
        raise APIError(400, f"request body must be a JSON object, got {_jtype(body)}",
                       code="invalid_json")
    return body


def _jtype(v: JSON) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, (int, float)):
        return "number"
    if isinstance(v, str):
        return "string"
    if isinstance(v, list):
        return "array"
    return "object"


# -- typed getters: each rejects bools posing as numbers, NaN/inf, and out-of-range values --------

def get_int(d: JSONObject, name: str, lo: int | None = None, hi: int | None = None,
            param: str | None = None) -> int | None:
    param = param or name
    v = d.get(name)
    if v is None:
        return None
    if isinstance(v, float) and v.is_integer() and abs(v) < 2**53:
        v = int(v)  # 16.0 is an integer to JSON's eye
    if isinstance(v, bool) or not isinstance(v, int):
        raise invalid(param, f"{param} must be an integer, got {_jtype(v)} {_short(v)}",
                      code="invalid_type")
    if lo is not None and v < lo:
        raise invalid(param, f"{param} must be >= {lo}, got {v}")
    if hi is not None and v > hi:
        raise invalid(param, f"{param} must be <= {hi}, got {_short(v)}")
    return v


def get_float(d: JSONObject, name: str, lo: float | None = None, hi: float | None = None,
              param: str | None = None) -> float | None:
    param = param or name
    v = d.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise invalid(param, f"{param} must be a number, got {_jtype(v)} {_short(v)}",
                      code="invalid_type")
    try:
        f = float(v)
    except OverflowError:
        raise invalid(param, f"{param} is too large: {_short(v)}") from None
    if not math.isfinite(f):
        raise invalid(param, f"{param} must be a finite number, got {f}")
    if lo is not None and f < lo:
        raise invalid(param, f"{param} must be >= {lo}, got {f}")
    if hi is not None and f > hi:
        raise invalid(param, f"{param} must be <= {hi}, got {f}")
    return f


def get_bool(d: JSONObject, name: str, param: str | None = None) -> bool | None:
    param = param or name
    v = d.get(name)
    if v is None:
        return None
    if not isinstance(v, bool):
        raise invalid(param, f"{param} must be true or false, got {_jtype(v)} {_short(v)}",
                      code="invalid_type")
    return v


def get_str(d: JSONObject, name: str, param: str | None = None) -> str | None:
    param = param or name
    v = d.get(name)
    if v is None:
        return None
    if not isinstance(v, str):
        raise invalid(param, f"{param} must be a string, got {_jtype(v)}", code="invalid_type")
    return v


def check_text(s: str, param: str) -> str:
    """Reject lone surrogates ("\\ud800" is legal JSON but not Unicode text)."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        raise invalid(param, f"{param} is not valid Unicode text (lone surrogate at "
                      f"character {e.start})") from None
    return s


def _short(v: object) -> str:
    s = repr(v)
    return s if len(s) <= 40 else s[:37] + "..."


def _stop(d: JSONObject, name: str = "stop", param: str | None = None) -> list[str] | None:
    param = param or name
    v = d.get(name)
    if v is None:
        return None
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise invalid(param, f"{param} must be a string or an array of strings",
                      code="invalid_type")
    if len(stops) > MAX_STOP:
        raise invalid(param, f"{param} has {len(stops)} strings; at most {MAX_STOP} are allowed")
    for s in stops:
        check_text(s, param)
        if not s:
            raise invalid(param, f"{param} strings must not be empty")
        if len(s) > MAX_STOP_CHARS:
            raise invalid(param, f"{param} strings must be at most {MAX_STOP_CHARS} characters, "
                          f"got {len(s)}")
    return stops or None


def token_ids(v: JSON, param: str, vocab_size: int, max_len: int | None = None) -> list[int]:
    """A JSON array of token ids, each in [0, vocab_size)."""
    if not isinstance(v, list):
        raise invalid(param, f"{param} must be an array of token ids", code="invalid_type")
    for i, t in enumerate(v):
        if isinstance(t, bool) or not isinstance(t, int):
            raise invalid(param, f"{param}[{i}] must be an integer token id, got {_jtype(t)}",
                          code="invalid_type")
        if not 0 <= t < vocab_size:
            raise invalid(param, f"{param}[{i}] = {_short(t)} is not a token id (vocabulary "
                          f"size {vocab_size})")
    if max_len is not None and len(v) > max_len:
        raise invalid(param, f"{param} has {len(v)} ids; at most {max_len} are allowed")
    return list(v)


def max_tokens_arg(d: JSONObject, name: str, context_length: int,
                   param: str | None = None) -> int | None:
    param = param or name
    v = get_int(d, name, 1, None, param)
    if v is not None and v > context_length:
        raise invalid(param, f"{param} ({v}) is larger than this model's context length "
                      f"({context_length} tokens)", code="context_length_exceeded")
    return v


# -- the field policy: every route knows every field it takes -------------------------------------
#
# A field a route does not list is refused with 400 `unknown_parameter`, whatever its value (a
# misspelt or newer field must never be silently dropped). A field listed in REFUSED_FIELDS is
# one peers or OpenAI define that this server does not implement: it is accepted only with a
# value that asks for nothing (null, false, an empty array or object, and the per-field values
# of OFF_STRINGS / OFF_ALSO such as service_tier "auto") and refused with 400 `unsupported`
# otherwise. HARMLESS_FIELDS carry information the
# server does not need to act on (OpenAI's end-user id) and are accepted as they are.

_COMMON_FIELDS = frozenset({
    "model", "stream", "stream_options", "n", "best_of", "temperature", "top_p", "top_k",
    "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty", "seed", "stop",
    "stop_token_ids", "ignore_eos", "skip_special_tokens", "max_tokens", "min_tokens",
    "logit_bias", "logprobs", "prompt_logprobs", "return_token_ids"})
HARMLESS_FIELDS = frozenset({"user"})
# Beam search and the rest that peers' servers take (structured output is
# core.server.structured's, except choosing its backend or whitespace per request).
_PEER_EXTRAS = ("guided_decoding_backend", "guided_whitespace_pattern",
                "use_beam_search", "length_penalty", "stop_regex", "cache_salt",
                "include_stop_str_in_output", "spaces_between_special_tokens",
                "truncate_prompt_tokens", "allowed_token_ids", "bad_words", "lora_request",
                "return_tokens_as_token_ids", "priority", "logits_processors",
                "min_tokens_stop", "add_special_tokens", "request_id", "kv_transfer_params",
                "vllm_xargs", "custom_logit_processor", "return_hidden_states", "lora_path",
                "chat_template", "documents", "mm_processor_kwargs", "media_io_kwargs")
# chat's (core.server.reasoning); on completions there is no template and no reasoning split
_CHAT_ONLY = ("separate_reasoning", "stream_reasoning", "chat_template_kwargs")
REFUSED_FIELDS = {
    "completions": frozenset(("suffix",) + _PEER_EXTRAS + _CHAT_ONLY),
    "chat": frozenset(("functions", "function_call", "audio", "prediction", "modalities",
                       "store", "metadata", "web_search_options", "reasoning_effort",
                       "service_tier", "echo", "continue_final_message") + _PEER_EXTRAS),
    "generate": frozenset(("return_text_in_logprobs", "image_data",
                           "audio_data", "modalities", "custom_logit_processor",
                           "return_hidden_states", "session_params", "bootstrap_host",
                           "data_parallel_rank", "stream_interval")),
}
MESSAGE_FIELDS = frozenset({"role", "content", "name", "tool_calls", "tool_call_id",
                            "reasoning_content"})
# what SDKs write back when a reply object is replayed as a message (null / empty there)
MESSAGE_REFUSED_FIELDS = frozenset({"function_call", "audio", "refusal", "annotations"})
MAX_TEMPLATE_KWARGS = 32  # chat_template_kwargs: variables
MAX_TEMPLATE_KWARGS_BYTES = 16 << 10  # chat_template_kwargs: its JSON text
# variables chat_template_kwargs may not set: the renderer's own, and the special tokens' names
# (a request must not rename the BOS token or replace raise_exception)
RESERVED_TEMPLATE_VARS = frozenset({
    "messages", "tools", "documents", "add_generation_prompt", "continue_final_message",
    "tokenize", "chat_template", "conversation", "return_dict", "return_tensors", "padding",
    "truncation", "max_length", "tokenizer_kwargs", "return_assistant_tokens_mask",
    "sanitize_control_tokens", "raise_exception", "strftime_now", "bos_token", "eos_token",
    "unk_token", "sep_token", "pad_token", "cls_token", "mask_token",
    "additional_special_tokens"})
_VARIABLE = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")
ROUTE_FIELDS = {
    "completions": _COMMON_FIELDS | HARMLESS_FIELDS | set(OPENAI_FIELDS) | {"prompt", "echo"},
    "chat": _COMMON_FIELDS | HARMLESS_FIELDS | set(OPENAI_FIELDS) | {"messages", "top_logprobs",
                                                "max_completion_tokens",
                                                "add_generation_prompt", "tools",
                                                "tool_choice", "parallel_tool_calls",
                                                *_CHAT_ONLY},
    "generate": frozenset({"text", "input_ids", "sampling_params", "stream", "rid",
                           "return_logprob", "top_logprobs_num", "logprob_start_len",
                           "lora_path"}),
}


# Off values beyond null / false / [] / {}: per field, since "none" is a regex and {} a schema.
SCHEMA_FIELDS = frozenset({"guided_json", "json_schema"})  # {}: any JSON, a constraint
OFF_STRINGS = {"service_tier": ("auto", "default"),
               "guided_decoding_backend": ("auto",)}
OFF_ALSO = {"modalities": (["text"],)}


def _is_off(name: str, v: JSON) -> bool:
    """Whether a refused field's value asks for nothing (so taking it changes nothing)."""
    if v is None or v is False:
        return True
    if isinstance(v, (list, dict)) and not v:
        return name not in SCHEMA_FIELDS
    if isinstance(v, str):
        return v in OFF_STRINGS.get(name, ())
    return isinstance(v, (list, dict)) and v in OFF_ALSO.get(name, ())


def check_fields(body: JSONObject, route: str) -> None:
    """Refuse unknown fields and refused fields with a value that would have an effect."""
    known, refused = ROUTE_FIELDS[route], REFUSED_FIELDS[route]
    for name in body:
        if name in known:
            continue
        if name in refused:
            if _is_off(name, body[name]):
                continue
            raise invalid(name, f"{name} is not supported by this server", code="unsupported")
        raise invalid(name, f"unknown parameter {_short(name)}: this route takes "
                      f"{', '.join(sorted(known))} (unknown fields are refused, never ignored)",
                      code="unknown_parameter")


# -- the OpenAI routes -------------------------------------------------------------------------

def _openai_sampling(body: JSONObject, vocab_size: int, context_length: int,
                     req: ParsedRequest) -> None:
    """Fill req from the OpenAI fields common to completions and chat (+ vLLM/SGLang extras)."""
    req.model = get_str(body, "model")
    req.stream = bool(get_bool(body, "stream"))
    req.n = get_int(body, "n", 1, MAX_N) or 1
    best_of = get_int(body, "best_of", 1, MAX_N)
    if best_of is not None and best_of != req.n:
        raise invalid("best_of", "best_of different from n is not supported", code="unsupported")
    opts = body.get("stream_options")
    if opts is not None:
        if not isinstance(opts, dict):
            raise invalid("stream_options", "stream_options must be an object",
                          code="invalid_type")
        if not req.stream:
            raise invalid("stream_options", "stream_options is only allowed with stream=true")
        for key in opts:
            if key != "include_usage":
                raise invalid(f"stream_options.{key}", f"unknown parameter stream_options."
                              f"{_short(key)}: stream_options takes include_usage",
                              code="unknown_parameter")
        req.include_usage = bool(get_bool(opts, "include_usage", "stream_options.include_usage"))
    s: dict[str, Any] = {}
    for name, (lo, hi) in OPENAI_RANGES.items():
        v = get_float(body, name, lo, hi)
        if v is not None:
            s[name] = v
    for name in ("min_p", "repetition_penalty"):
        v = get_float(body, name)
        if v is not None:
            s[name] = v
    top_k = get_int(body, "top_k", -1, vocab_size)
    if top_k is not None:
        s["top_k"] = top_k
    seed = get_int(body, "seed", SEED_MIN, SEED_MAX)
    if seed is not None:
        s["seed"] = seed
    for name in ("ignore_eos", "skip_special_tokens"):
        v = get_bool(body, name)
        if v is not None:
            s[name] = v
    stop = _stop(body)
    if stop:
        s["stop"] = stop
    if body.get("stop_token_ids") is not None:
        s["stop_token_ids"] = token_ids(body["stop_token_ids"], "stop_token_ids", vocab_size,
                                        MAX_STOP_TOKEN_IDS)
    max_tokens = max_tokens_arg(body, "max_tokens", context_length)
    mct = max_tokens_arg(body, "max_completion_tokens", context_length)
    if max_tokens is not None and mct is not None and max_tokens != mct:
        raise invalid("max_completion_tokens", "max_tokens and max_completion_tokens differ")
    req.max_new_tokens = mct if mct is not None else max_tokens
    min_tokens = get_int(body, "min_tokens", 0, context_length)
    if min_tokens:
        if req.max_new_tokens is not None and min_tokens > req.max_new_tokens:
            raise invalid("min_tokens", f"min_tokens ({min_tokens}) is larger than max_tokens "
                          f"({req.max_new_tokens})")
        s["min_new_tokens"] = min_tokens
    bias = logit_bias(body.get("logit_bias"), "logit_bias", vocab_size)
    if bias:
        s["logit_bias"] = bias
    plp = get_int(body, "prompt_logprobs", 0, MAX_LOGPROBS)
    if plp is not None:
        req.prompt_logprobs = plp
    req.return_token_ids = bool(get_bool(body, "return_token_ids"))
    constraint = constraint_of(body, OPENAI_FIELDS)
    if constraint is not None:
        s["constraint"] = constraint
    req.sampling = s


def parse_completion(body: JSONObject, vocab_size: int, context_length: int
                     ) -> ParsedRequest:
    req = ParsedRequest(route="completions", prompts=[])
    check_fields(body, "completions")
    _openai_sampling(body, vocab_size, context_length, req)
    if "prompt" not in body:
        raise invalid("prompt", "prompt is required", code="missing_required_parameter")
    p = body["prompt"]
    if isinstance(p, str):
        req.prompts = [Prompt(text=check_text(p, "prompt"))]
    elif isinstance(p, list) and p and all(isinstance(x, str) for x in p):
        req.prompts = [Prompt(text=check_text(x, f"prompt[{i}]")) for i, x in enumerate(p)]
    elif isinstance(p, list) and p and all(isinstance(x, list) for x in p):
        req.prompts = [Prompt(ids=token_ids(x, f"prompt[{i}]", vocab_size))
                       for i, x in enumerate(p)]
    elif isinstance(p, list) and p and all(not isinstance(x, (str, list)) for x in p):
        req.prompts = [Prompt(ids=token_ids(p, "prompt", vocab_size))]
    elif isinstance(p, list) and not p:
        raise invalid("prompt", "prompt must not be an empty array")
    else:
        raise invalid("prompt", "prompt must be a string, an array of strings, an array of token "
                      "ids or an array of arrays of token ids", code="invalid_type")
    lp = get_int(body, "logprobs", 0, MAX_LOGPROBS)
    if lp is not None:
        req.logprobs, req.top_logprobs = True, lp
    req.echo = bool(get_bool(body, "echo"))
    if req.echo and req.logprobs:
        # OpenAI: the logprobs then cover the prompt's tokens too (the first one has none)
        req.prompt_logprobs = max(req.prompt_logprobs or 0, req.top_logprobs)
    _prompt_logprobs_sampling(req)
    _check_sequences(req)
    return req


def _prompt_logprobs_sampling(req: ParsedRequest) -> None:
    if req.prompt_logprobs is not None:
        req.sampling["prompt_logprobs"] = req.prompt_logprobs


def logit_bias(v: JSON, param: str, vocab_size: int) -> dict[int, float] | None:
    """OpenAI's logit_bias: {token id (a string key in JSON): bias in [-100, 100]}."""
    if v is None:
        return None
    if not isinstance(v, dict):
        raise invalid(param, f"{param} must be an object mapping token ids to biases",
                      code="invalid_type")
    out: dict[int, float] = {}
    for k, b in v.items():
        try:
            tok = int(k)
        except (TypeError, ValueError):
            raise invalid(param, f"{param} key {_short(k)} is not a token id") from None
        if not 0 <= tok < vocab_size:
            raise invalid(param, f"{param} key {tok} is not a token id (vocabulary size "
                          f"{vocab_size})")
        if isinstance(b, bool) or not isinstance(b, (int, float)) or not math.isfinite(b) \
                or not -100 <= b <= 100:
            raise invalid(f"{param}.{k}", f"{param}[{k}] must be a number in [-100, 100], "
                          f"got {_short(b)}")
        out[tok] = float(b)
    if len(out) > MAX_LOGIT_BIAS:
        raise invalid(param, f"{param} has {len(out)} entries; at most {MAX_LOGIT_BIAS}")
    return out


def parse_chat(body: JSONObject, vocab_size: int, context_length: int) -> ParsedRequest:
    req = ParsedRequest(route="chat", prompts=[])
    check_fields(body, "chat")
    _openai_sampling(body, vocab_size, context_length, req)
    req.prompts = [Prompt(messages=_messages(body.get("messages")))]
    req.tools = parse_tools(body)
    check_with_constraint(req.tools, req.sampling.get("constraint"))
    lp = get_bool(body, "logprobs")
    top = get_int(body, "top_logprobs", 0, MAX_LOGPROBS)
    if top is not None and not lp:
        raise invalid("top_logprobs", "top_logprobs requires logprobs=true")
    req.logprobs, req.top_logprobs = bool(lp), top or 0
    agp = get_bool(body, "add_generation_prompt")
    req.add_generation_prompt = True if agp is None else agp
    req.separate_reasoning = get_bool(body, "separate_reasoning")
    req.stream_reasoning = get_bool(body, "stream_reasoning")
    req.chat_template_kwargs = _template_kwargs(body.get("chat_template_kwargs"))
    _prompt_logprobs_sampling(req)
    _check_sequences(req)
    return req


def _template_kwargs(v: JSON) -> dict[str, JSON]:
    """chat_template_kwargs: an object of template variables, bounded, none of the reserved."""
    param = "chat_template_kwargs"
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise invalid(param, f"{param} must be an object of template variables",
                      code="invalid_type")
    if len(v) > MAX_TEMPLATE_KWARGS:
        raise invalid(param, f"{param} has {len(v)} entries; at most {MAX_TEMPLATE_KWARGS}")
    for key in v:
        if not _VARIABLE.fullmatch(key):
            raise invalid(param, f"{param} key {_short(key)} is not a template variable name "
                          "(letters, digits and '_', at most 64)")
        if key in RESERVED_TEMPLATE_VARS:
            raise invalid(f"{param}.{key}", f"{param}.{key}: the server sets `{key}` itself; "
                          "it cannot be given here")
    try:
        size = len(json.dumps(v, ensure_ascii=False).encode("utf-8"))
    except UnicodeEncodeError as e:
        raise invalid(param, f"{param} is not valid Unicode text (lone surrogate at character "
                      f"{e.start})") from None
    if size > MAX_TEMPLATE_KWARGS_BYTES:
        raise invalid(param, f"{param} is {size} bytes of JSON; at most "
                      f"{MAX_TEMPLATE_KWARGS_BYTES}")
    return dict(v)


def _messages(v: JSON) -> list[ChatMessage]:
    if v is None:
        raise invalid("messages", "messages is required", code="missing_required_parameter")
    if not isinstance(v, list):
        raise invalid("messages", "messages must be an array", code="invalid_type")
    if not v:
        raise invalid("messages", "messages must not be empty")
    if len(v) > MAX_MESSAGES:
        raise invalid("messages", f"messages has {len(v)} entries; at most {MAX_MESSAGES}")
    out: list[ChatMessage] = []
    for i, m in enumerate(v):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise invalid(where, f"{where} must be an object", code="invalid_type")
        role = m.get("role")
        if role not in CHAT_ROLES:
            raise invalid(f"{where}.role", f"{where}.role must be one of "
                          f"{', '.join(CHAT_ROLES)}, got {_short(role)}")
        for key, v in m.items():
            if key in MESSAGE_FIELDS:
                continue
            if key in MESSAGE_REFUSED_FIELDS:
                if not _is_off(key, v):
                    raise invalid(f"{where}.{key}", f"{where}.{key} is not supported by this "
                                  "server", code="unsupported")
                continue
            raise invalid(f"{where}.{key}", f"unknown parameter {where}.{_short(key)}: a "
                          f"message takes {', '.join(sorted(MESSAGE_FIELDS))}",
                          code="unknown_parameter")
        extra = message_fields(m, where, role)
        content = m.get("content")
        if content is None and "tool_calls" in extra:
            content = ""  # an assistant turn that only calls tools
        if isinstance(content, list):
            parts = []
            for j, part in enumerate(content):
                pw = f"{where}.content[{j}]"
                if not isinstance(part, dict) or part.get("type") != "text":
                    raise invalid(pw, f"{pw} must be a text part {{\"type\": \"text\", "
                                  "\"text\": ...}; other content types are not supported")
                if not isinstance(part.get("text"), str):
                    raise invalid(f"{pw}.text", f"{pw}.text must be a string",
                                  code="invalid_type")
                parts.append(part["text"])
            content = "".join(parts)
        elif not isinstance(content, str):
            raise invalid(f"{where}.content", f"{where}.content must be a string or an array "
                          f"of text parts, got {_jtype(content)}", code="invalid_type")
        msg: ChatMessage = {"role": "system" if role == "developer" else role,
                            "content": check_text(content, f"{where}.content")}
        name = get_str(m, "name", f"{where}.name")
        if name is not None:
            msg["name"] = name
        reasoning = get_str(m, "reasoning_content", f"{where}.reasoning_content")
        if reasoning is not None:  # a reply replayed: the template may show it (Qwen3's does)
            if role != "assistant":
                raise invalid(f"{where}.reasoning_content", f"{where}.reasoning_content: only "
                              "assistant messages carry reasoning")
            msg["reasoning_content"] = check_text(reasoning, f"{where}.reasoning_content")
        msg.update(extra)
        out.append(msg)
    name_tool_results(out)
    return out


# -- the native route --------------------------------------------------------------------------

def parse_generate(body: JSONObject, vocab_size: int, context_length: int) -> ParsedRequest:
    """SGLang's /generate: text or input_ids (one or a batch), sampling_params, stream."""
    req = ParsedRequest(route="generate", prompts=[])
    check_fields(body, "generate")
    text, ids = body.get("text"), body.get("input_ids")
    if (text is None) == (ids is None):
        raise invalid("text", "give exactly one of text and input_ids",
                      code="missing_required_parameter")
    if text is not None:
        if isinstance(text, str):
            req.prompts = [Prompt(text=check_text(text, "text"))]
        elif isinstance(text, list) and text and all(isinstance(t, str) for t in text):
            req.prompts = [Prompt(text=check_text(t, f"text[{i}]")) for i, t in enumerate(text)]
            req.batch = True
        else:
            raise invalid("text", "text must be a string or a non-empty array of strings",
                          code="invalid_type")
    elif isinstance(ids, list) and ids and all(isinstance(x, list) for x in ids):
        req.prompts = [Prompt(ids=token_ids(x, f"input_ids[{i}]", vocab_size))
                       for i, x in enumerate(ids)]
        req.batch = True
    else:
        req.prompts = [Prompt(ids=token_ids(ids, "input_ids", vocab_size))]
    req.loras = _lora_path(body.get("lora_path"), len(req.prompts))
    req.stream = bool(get_bool(body, "stream"))
    rid = body.get("rid")
    if rid is not None and (req.batch or not isinstance(rid, str) or not 0 < len(rid) <= 128):
        raise invalid("rid", "rid must be a string of 1..128 characters, for one prompt")
    req.rid = rid
    req.logprobs = bool(get_bool(body, "return_logprob"))
    req.top_logprobs = get_int(body, "top_logprobs_num", 0, MAX_LOGPROBS) or 0
    start = get_int(body, "logprob_start_len", -1, None)
    if start is not None and start >= 0:  # SGLang: -1 (the default) is output tokens only
        if not req.logprobs:
            raise invalid("logprob_start_len", "logprob_start_len requires return_logprob=true")
        req.logprob_start_len, req.prompt_logprobs = start, req.top_logprobs
    sp = body.get("sampling_params") or {}
    if not isinstance(sp, dict):
        raise invalid("sampling_params", "sampling_params must be an object",
                      code="invalid_type")
    unknown = sorted(set(sp) - set(NATIVE_SAMPLING_KEYS))
    if unknown:
        raise invalid(f"sampling_params.{unknown[0]}", "unknown sampling parameter(s): "
                      f"{', '.join(unknown)}", code="unsupported")
    s: dict[str, Any] = {}
    for name in ("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty",
                 "repetition_penalty"):
        v = get_float(sp, name, param=f"sampling_params.{name}")
        if v is not None:
            s[name] = v
    for name, lo in (("top_k", -1), ("min_new_tokens", 0)):
        v = get_int(sp, name, lo, max(vocab_size, context_length), f"sampling_params.{name}")
        if v is not None:
            s[name] = v
    for name in ("seed", "sampling_seed"):
        v = get_int(sp, name, SEED_MIN, SEED_MAX, f"sampling_params.{name}")
        if v is not None:
            s["seed"] = v
    for name in ("ignore_eos", "skip_special_tokens"):
        v = get_bool(sp, name, f"sampling_params.{name}")
        if v is not None:
            s[name] = v
    stop = _stop(sp, "stop", "sampling_params.stop")
    if stop:
        s["stop"] = stop
    if sp.get("stop_token_ids") is not None:
        s["stop_token_ids"] = token_ids(sp["stop_token_ids"], "sampling_params.stop_token_ids",
                                        vocab_size, MAX_STOP_TOKEN_IDS)
    req.max_new_tokens = max_tokens_arg(sp, "max_new_tokens", context_length,
                                        "sampling_params.max_new_tokens")
    req.n = get_int(sp, "n", 1, MAX_N, "sampling_params.n") or 1
    bias = logit_bias(sp.get("logit_bias"), "sampling_params.logit_bias", vocab_size)
    if bias:
        s["logit_bias"] = bias
    constraint = constraint_of(sp, dict(NATIVE_FIELDS), "sampling_params.")
    if constraint is not None:
        s["constraint"] = constraint
    req.sampling = s
    _prompt_logprobs_sampling(req)
    _check_sequences(req)
    return req


def _lora_path(value: JSON, prompts: int) -> list[str | None] | None:
    """SGLang's lora_path: one adapter name for every prompt, or one per prompt (null: the
    base model); whether the names are loaded is the server's check."""
    if value is None:
        return None
    if isinstance(value, str):
        return [value] * prompts
    if isinstance(value, list) and len(value) == prompts and all(
            v is None or isinstance(v, str) for v in value):
        return list(value)
    raise invalid("lora_path", f"lora_path must be an adapter name, or a list of {prompts} "
                  "(one per prompt, null for the base model)", code="invalid_type")


def _check_sequences(req: ParsedRequest) -> None:
    total = len(req.prompts) * req.n
    if total > MAX_SEQUENCES:
        raise invalid("n", f"{len(req.prompts)} prompt(s) x n={req.n} = {total} sequences; at "
                      f"most {MAX_SEQUENCES} per request")
