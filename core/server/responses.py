"""Response bodies: OpenAI completion / chat objects and chunks, SGLang /generate objects.

`SeqOut` accumulates one generated sequence from the engine's deltas (core.frontend.delta.Delta);
the builders turn finished sequences (or what one delta added) into the JSON shapes clients
expect. A logprob is the engine's `TokenLogprob` beside its token id (`Entry`) until a builder
spells it the way its API does.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from core.frontend.delta import Delta
from core.messages import TokenLogprob
from core.server.protocol import ParsedRequest
from core.server.tools import final_message

if TYPE_CHECKING:
    from core.contract.json_types import JSON, JSONObject
    from core.server.reasoning import ChoiceReasoning
    from core.server.tools import AssistantMessage, CallReader, MessageDelta

Piece = Callable[[int], bytes]  # token id -> the bytes it stands for (TokenizerLike.token_bytes)
# a token and its logprob with the top alternatives; None for the first prompt token (it has none)
Entry = tuple[int, TokenLogprob | None]


def token_text(piece: bytes) -> str:
    """A token's bytes as logprobs show it: its text where the bytes are whole UTF-8, else
    OpenAI's `bytes:` spelling with what is not a whole character escaped (`bytes: \\xf0\\x9f`
    is a space and the start of an emoji). Never U+FFFD: a client joins `bytes`, not this."""
    try:
        return piece.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + piece.decode("utf-8", "backslashreplace")


def dumps(obj: JSON) -> bytes:
    # UTF-8 out; a stray surrogate cannot reach here from input (rejected), 'replace' is a guard
    return json.dumps(obj, ensure_ascii=False).encode("utf-8", "replace")


def sse(obj: JSON | bytes) -> bytes:
    return b"data: " + (obj if isinstance(obj, bytes) else dumps(obj)) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


@dataclass
class SeqOut:
    """One output sequence (a prompt x one of its n choices) as it is being generated."""

    index: int
    prompt_index: int
    rid: str
    prompt_text: str | None = None  # for echo
    prompt_ids: tuple[int, ...] = ()
    # prompt tokens 1.. as the engine sent them, when asked for
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per token id, when asked
    finished: bool = False
    finish_reason: str | None = None
    matched_stop: int | str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    error: str | None = None
    started: bool = False  # a first chunk was sent (stream)
    # speculative decoding's per-request counts (Delta.spec, on the last delta)
    spec: dict[str, int | str] | None = None

    def add(self, d: Delta) -> None:
        self.text.append(d.text)
        self.token_ids.extend(d.token_ids)
        if d.logprobs:
            self.logprobs.extend(d.logprobs)
        if d.prompt_logprobs is not None:
            self.prompt_logprobs = d.prompt_logprobs
        if d.error is not None:
            self.error = d.error
        if d.finish is not None:
            self.finished = True
            self.finish_reason = "error" if self.error is not None else d.finish.type
            self.matched_stop = d.finish.matched
            self.prompt_tokens = d.prompt_tokens
            self.completion_tokens = d.completion_tokens or len(self.token_ids)
            self.cached_tokens = d.cached_tokens
            if d.spec:
                self.spec = dict(d.spec)

    def output_entries(self, start: int = 0) -> list[tuple[int, TokenLogprob]]:
        """The output tokens from `start` with their logprobs (those asked for)."""
        return list(zip(self.token_ids[start:], self.logprobs[start:], strict=True))

    @property
    def full_text(self) -> str:
        return "".join(self.text)


def usage(seqs: Sequence[SeqOut], prompt_lens: Sequence[int], cache_report: bool,
          cached_by_prompt: dict[int, int] | None = None) -> JSONObject:
    # prompt tokens count once per prompt, not once per choice (as OpenAI reports n > 1)
    prompt = sum(prompt_lens)
    completion = sum(s.completion_tokens for s in seqs)
    u: JSONObject = {"prompt_tokens": prompt, "completion_tokens": completion,
                         "total_tokens": prompt + completion}
    if cache_report:
        cached = cached_by_prompt or {}
        for s in seqs:  # the best reuse among a prompt's choices
            cached[s.prompt_index] = max(cached.get(s.prompt_index, 0), s.cached_tokens)
        u["prompt_tokens_details"] = {"cached_tokens": sum(cached.values())}
    return u


def prompt_entries(s: SeqOut) -> list[Entry]:
    """The prompt's tokens as logprob entries: the first has none (logprob and top null, as
    OpenAI and SGLang give it), then what the engine sent."""
    if not s.prompt_ids:
        return []
    rest = s.prompt_logprobs or ()
    return [(s.prompt_ids[0], None), *zip(s.prompt_ids[1:1 + len(rest)], rest, strict=True)]


def echo_entries(s: SeqOut, top: int) -> list[Entry]:
    """completions' echo with logprobs: prompt_entries with up to `top` alternatives each."""
    return [(t, lp if lp is None else TokenLogprob(lp.logprob, lp.top[:top]))
            for t, lp in prompt_entries(s)]


def completion_logprobs(entries: Sequence[Entry], piece: Piece, offset: int
                        ) -> JSONObject:
    """OpenAI's legacy shape. `top_logprobs` holds the top alternatives and, as OpenAI's does,
    the sampled token too (so logprobs=0 gives {sampled: logprob}); `text_offset` counts the
    characters before each token (the tokens of a character split over several all sit at
    that character's offset). An entry whose logprob is None (echo's first prompt token) has
    null logprob and top_logprobs."""
    tokens, lps, tops, offsets = [], [], [], []
    done = b""
    for tid, e in entries:
        raw = piece(tid)
        tok = token_text(raw)
        tokens.append(tok)
        offsets.append(offset + len(done.decode("utf-8", "ignore")))
        done += raw
        if e is None:
            lps.append(None)
            tops.append(None)
            continue
        lps.append(e.logprob)
        top = {token_text(piece(t)): lp for t, lp in e.top}
        top.setdefault(tok, e.logprob)
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops,
            "text_offset": offsets}


def chat_logprobs(entries: Sequence[Entry], piece: Piece) -> JSONObject:
    """Chat's shape: per token its text, logprob and bytes, and its top alternatives alike."""
    def one(tid: int, lp: float) -> JSONObject:
        raw = piece(tid)
        return {"token": token_text(raw), "logprob": lp, "bytes": list(raw)}

    content = []
    for tid, e in entries:
        if e is None:  # (chat has no echo: never the first prompt token)
            raise ValueError("chat logprobs need every token's logprob")
        item = one(tid, e.logprob)
        item["top_logprobs"] = [one(t, lp) for t, lp in e.top]
        content.append(item)
    return {"content": content}


def vllm_prompt_logprobs(s: SeqOut, piece: Piece) -> list[JSON] | None:
    """vLLM's prompt_logprobs: null for the first prompt token, then per token
    {token id: {"logprob", "rank", "decoded_token"}} holding the prompt token and its top
    alternatives (rank: 1-based among the vocabulary; the prompt token's is the engine's,
    how many tokens are at least as likely, null where an engine sends none)."""
    if s.prompt_logprobs is None:
        return None
    out: list[JSON] = [None] if s.prompt_ids else []
    for tid, e in prompt_entries(s)[1:]:
        assert e is not None  # only the first prompt token has none
        d = {str(t): {"logprob": lp, "rank": r, "decoded_token": token_text(piece(t))}
             for r, (t, lp) in enumerate(e.top, 1)}
        d.setdefault(str(tid), {"logprob": e.logprob, "rank": e.rank,
                                "decoded_token": token_text(piece(tid))})
        out.append(d)
    return out


def _extras(choice: JSONObject, s: SeqOut, req: ParsedRequest, piece: Piece,
            prompt_side: bool) -> JSONObject:
    """vLLM's extra response fields a request asked for: prompt_logprobs, token ids (the
    prompt's on the choice for completions, on the response for chat: prompt_side)."""
    if req.return_token_ids:
        choice["token_ids"] = list(s.token_ids)
        if prompt_side:
            choice["prompt_token_ids"] = list(s.prompt_ids)
    if prompt_side and req.prompt_logprobs is not None and not (req.echo and req.logprobs):
        choice["prompt_logprobs"] = vllm_prompt_logprobs(s, piece)
    return choice


def completion_object(rid: str, created: int, model: str, req: ParsedRequest,
                      seqs: list[SeqOut], piece: Piece, use: JSONObject
                      ) -> JSONObject:
    choices = []
    for s in seqs:
        prefix = s.prompt_text if req.echo and s.prompt_text is not None else ""
        entries = s.output_entries() if req.logprobs else []
        if req.echo and req.logprobs:
            entries = echo_entries(s, req.top_logprobs) + entries
        choices.append(_extras(
            {"index": s.index, "text": prefix + s.full_text,
             "logprobs": completion_logprobs(entries, piece, 0 if req.echo else len(prefix))
             if req.logprobs else None,
             "finish_reason": s.finish_reason}, s, req, piece, True))
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": choices, "usage": use}


def chat_object(rid: str, created: int, model: str, req: ParsedRequest, seqs: list[SeqOut],
                piece: Piece, use: JSONObject, tool_parser: CallReader | None = None,
                reasoning: Sequence[ChoiceReasoning | None] = ()) -> JSONObject:
    """tool_parser: what reads each answer for tool calls (core.server.tools), or None;
    reasoning: each choice's split (core.server.reasoning; None or absent: not split). The
    reasoning is split off first, then calls are read from the content."""
    choices = []
    for k, s in enumerate(seqs):
        split = reasoning[k] if k < len(reasoning) else None
        thought, text = split.split(s.full_text) if split is not None else (None, s.full_text)
        message: JSONObject | AssistantMessage = {"role": "assistant", "content": text}
        finish = s.finish_reason
        if tool_parser is not None:
            message, finish = final_message(tool_parser, req.tools, text, finish)
        if split is not None:
            message = {**message, "reasoning_content": thought}
            if tool_parser is None and not text and thought is not None:
                message["content"] = None  # the reasoning took the whole output
        choices.append(_extras({"index": s.index, "message": message,
                                "logprobs": chat_logprobs(s.output_entries(), piece)
                                if req.logprobs else None,
                                "finish_reason": finish}, s, req, piece, False))
    body = {"id": rid, "object": "chat.completion", "created": created, "model": model,
            "choices": choices, "usage": use}
    return {**body, **chat_prompt_fields(seqs[0], req, piece)} if seqs else body


def chat_prompt_fields(s: SeqOut, req: ParsedRequest, piece: Piece) -> JSONObject:
    """Chat's response-level extras (vLLM): prompt_token_ids and prompt_logprobs (one prompt,
    so the same for every choice)."""
    out: JSONObject = {}
    if req.return_token_ids:
        out["prompt_token_ids"] = list(s.prompt_ids)
    if req.prompt_logprobs is not None:
        out["prompt_logprobs"] = vllm_prompt_logprobs(s, piece)
    return out


def generate_meta(s: SeqOut, req: ParsedRequest, e2e: float | None, piece: Piece
                  ) -> JSONObject:
    finish = None
    if s.finished:
        finish = {"type": s.finish_reason}
        if s.matched_stop is not None:
            finish["matched"] = s.matched_stop
        if s.finish_reason == "length":
            finish["length"] = s.completion_tokens
    meta: JSONObject = {"id": s.rid, "finish_reason": finish,
                            "prompt_tokens": s.prompt_tokens,
                            "completion_tokens": s.completion_tokens or len(s.token_ids),
                            "cached_tokens": s.cached_tokens}
    if e2e is not None:
        meta["e2e_latency"] = e2e
    if s.spec:  # as the offline Engine's: spec_verify_ct, spec_*_tokens, spec_note
        meta.update({k: v for k, v in s.spec.items() if v is not None})
    if req.logprobs:
        # SGLang's shape: [logprob, token_id, token_text] per token, top-k likewise per token
        entries = s.output_entries()
        meta["output_token_logprobs"] = [[e.logprob, t, token_text(piece(t))]
                                         for t, e in entries]
        meta["output_top_logprobs"] = [[[lp, t, token_text(piece(t))] for t, lp in e.top]
                                       for _, e in entries]
    if req.prompt_logprobs is not None and s.prompt_logprobs is not None:
        # SGLang's input_token_logprobs from logprob_start_len (the first prompt token: null)
        entries = prompt_entries(s)[req.logprob_start_len:]
        meta["input_token_logprobs"] = [[None if e is None else e.logprob, t,
                                         token_text(piece(t))] for t, e in entries]
        meta["input_top_logprobs"] = [None if e is None else
                                      [[lp, t, token_text(piece(t))] for t, lp in e.top]
                                      for _, e in entries]
    return meta


def generate_object(s: SeqOut, req: ParsedRequest, e2e: float | None, piece: Piece
                    ) -> JSONObject:
    return {"text": s.full_text, "output_ids": list(s.token_ids),
            "meta_info": generate_meta(s, req, e2e, piece)}


def completion_chunk(rid: str, created: int, model: str, index: int, text: str,
                     finish_reason: str | None, logprobs: JSONObject | None
                     ) -> JSONObject:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": index, "text": text, "logprobs": logprobs,
                         "finish_reason": finish_reason}]}


def chat_chunk(rid: str, created: int, model: str, index: int,
               delta: JSONObject | MessageDelta,
               finish_reason: str | None, logprobs: JSONObject | None) -> JSONObject:
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": index, "delta": delta, "logprobs": logprobs,
                         "finish_reason": finish_reason}]}


def usage_chunk(rid: str, created: int, model: str, obj: str, use: JSONObject
                ) -> JSONObject:
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [],
            "usage": use}
