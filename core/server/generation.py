"""The generation routes: parse -> tokenize (worker thread) -> fan out to the engine -> answer.

A request becomes len(prompts) x n engine requests. Their delta streams are merged; whatever ends
the HTTP request early (client gone, handler cancelled, an error) aborts every engine request that
has not finished, so its KV pages are freed at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from aiohttp import web

from core.frontend.delta import Delta
from core.frontend.refusal import Refused
from core.server import protocol, responses, tools
from core.server.engine_api import GenRequest
from core.server.errors import APIError, invalid
from core.server.protocol import ParsedRequest
from core.server.state import OUTCOME, ServerState, state

if TYPE_CHECKING:
    from core.contract.json_types import JSON, JSONObject
    from core.server.engine_api import TokenizerLike

log = logging.getLogger("core.server")

# max_new_tokens when the client gives none: OpenAI's completions default is 16, chat runs to the
# end of the context (stopped by EOS in practice), SGLang's /generate default is 128.
DEFAULT_MAX_NEW = {"completions": 16, "chat": None, "generate": 128}
PARSERS = {"completions": protocol.parse_completion, "chat": protocol.parse_chat,
           "generate": protocol.parse_generate}
ID_PREFIX = {"completions": "cmpl", "chat": "chatcmpl", "generate": "gen"}
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
               "X-Accel-Buffering": "no"}


def _param(route: str, sglang_name: str) -> str:
    if route == "generate":
        return f"sampling_params.{sglang_name}"
    return {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens"}.get(sglang_name,
                                                                              sglang_name)


def _prompt_param(route: str) -> str:
    return {"completions": "prompt", "chat": "messages", "generate": "text"}[route]


def _validate_sampling(st: ServerState, req: ParsedRequest) -> None:
    probe = dict(req.sampling)
    # the final max_new_tokens is known after tokenizing; until then the widest it can be
    probe["max_new_tokens"] = req.max_new_tokens or st.engine.context_length
    try:
        st.engine.validate_sampling(probe)
    except ValueError as e:
        msg = str(e)
        source = (probe.get("constraint") or {}).get("source")
        if source and msg.startswith(source):  # structured output: the request field named
            raise invalid(source, msg) from None
        named = min((k for k in probe if k in msg), key=msg.index, default=None)
        raise invalid(_param(req.route, named) if named else None, msg) from None


def _tokenize(st: ServerState, req: ParsedRequest) -> list[tuple[list[int], str | None]]:
    """Runs in a worker thread: chat template and tokenizer never touch the event loop."""
    tok = st.engine.tokenizer
    out: list[tuple[list[int], str | None]] = []
    for i, p in enumerate(req.prompts):
        if p.ids is not None:
            out.append((p.ids, _echo_text(tok, p.ids) if req.echo else None))
            continue
        if p.messages is not None:
            if not st.args.allow_special_tokens_in_messages:
                _refuse_control_text(tok, p.messages, req.tools, req.chat_template_kwargs)
            messages, offered = st.tools.render(p.messages, req.tools)
            # tools= only when there are some: a template or tokenizer without tools takes it
            kw = {"tools": offered} if offered else {}
            try:
                text = tok.apply_chat_template(messages,
                                               add_generation_prompt=req.add_generation_prompt,
                                               **kw, **req.chat_template_kwargs)
            except Exception as e:  # a template's raise_exception(...) or a type it refuses
                raise invalid("messages", f"the chat template refused these messages: {e}",
                              code="chat_template_error") from None
        else:
            text = p.text or ""
        try:
            # a rendered chat template already holds the special tokens (BOS...) it wants
            ids = tok.encode(text, add_special_tokens=p.messages is None)
            out.append((list(ids), text))
        except Exception as e:
            where = _prompt_param(req.route) + (f"[{i}]" if len(req.prompts) > 1 else "")
            raise invalid(where, f"{where} could not be tokenized: {e}") from None
    return out


def _echo_text(tok: TokenizerLike, ids: list[int]) -> str:
    """The echo of a prompt given as token ids: its tokens' bytes joined, as echo's logprobs
    show each token, special tokens included (vLLM echoes them too: its decode keeps them),
    so that text, tokens and text_offset agree."""
    return b"".join(tok.token_bytes(t) for t in ids).decode("utf-8", "replace")


def _refuse_control_text(tok: TokenizerLike, messages: list[protocol.ChatMessage],
                         treq: tools.ToolRequest | None = None,
                         kwargs: JSONObject | None = None) -> None:
    """Message text that spells a special token (`<|im_start|>system`...) would become that
    control token once the template's output is tokenized: a user could forge a turn of
    another role. The same for what else the template renders: tool calls, tool definitions.
    Refused unless --allow-special-tokens-in-messages."""
    specials = [t for t in tok.special_tokens if t]
    texts = [(f"messages[{i}].content", m["content"]) for i, m in enumerate(messages)]
    texts += [(f"messages[{i}].reasoning_content", m["reasoning_content"])
              for i, m in enumerate(messages) if "reasoning_content" in m]
    if kwargs:  # a template may print a variable's value into the prompt
        texts.append(("chat_template_kwargs", json.dumps(kwargs, ensure_ascii=False)))
    for where, text in texts + tools.texts_of(messages, treq):
        found = next((t for t in specials if t in text), None)
        if found is not None:
            raise invalid(where, f"{where} contains the "
                          f"special token text {found!r}, which the chat template would turn "
                          "into a control token; remove it (the server refuses this unless "
                          "started with --allow-special-tokens-in-messages)",
                          code="special_token_in_content")


def _fit(route: str, prompt_len: int, max_new: int | None, context: int, where: str) -> int:
    if prompt_len == 0:
        raise invalid(where, f"{where} is empty (0 tokens)")
    if prompt_len >= context:
        raise APIError(400, f"{where} has {prompt_len} tokens but this model's context length is "
                       f"{context} tokens (at least one must be left for the output)",
                       param=where, code="context_length_exceeded")
    if max_new is not None:
        if prompt_len + max_new > context:
            name = _param(route, "max_new_tokens")
            raise APIError(400, f"this model's context length is {context} tokens, but "
                           f"{prompt_len + max_new} were requested ({prompt_len} in the prompt + "
                           f"{max_new} {name}); shorten the prompt or lower {name}",
                           param=name, code="context_length_exceeded")
        return max_new
    default = DEFAULT_MAX_NEW[route]
    return context - prompt_len if default is None else min(default, context - prompt_len)


class _Job:
    """One HTTP generation request after tokenizing: its engine requests and their outputs."""

    def __init__(self, st: ServerState, req: ParsedRequest,
                 toks: list[tuple[list[int], str | None]], arrived: float):
        self.st, self.req = st, req
        self.t0 = arrived  # time.monotonic() when the request came in: TTFT counts from here
        self.created = int(time.time())
        self.base = req.rid or f"{ID_PREFIX[req.route]}-{uuid.uuid4().hex}"
        # responses name the model asked for: the served model, or the adapter OpenAI's
        # `model` selected
        self.model = req.model if req.model is not None and req.loras else st.model_name
        self.prompt_lens = [len(ids) for ids, _ in toks]
        ctx = st.engine.context_length
        total = len(toks) * req.n
        self.gen: list[GenRequest] = []
        self.seqs: list[responses.SeqOut] = []
        for pi, (ids, text) in enumerate(toks):
            where = _prompt_param(req.route) + (f"[{pi}]" if len(toks) > 1 else "")
            max_new = _fit(req.route, len(ids), req.max_new_tokens, ctx, where)
            for j in range(req.n):
                index = pi * req.n + j
                sampling = dict(req.sampling, max_new_tokens=max_new)
                if "seed" in sampling and j:  # n choices from one seed must still differ
                    # stays a signed 64-bit integer: wraps from 2^63 - 1 to -2^63
                    sampling["seed"] = (sampling["seed"] + j + 2**63) % 2**64 - 2**63
                rid = self.base if total == 1 else f"{self.base}-{index}"
                self.gen.append(GenRequest(rid=rid, input_ids=tuple(ids), sampling=sampling,
                                           logprobs=req.logprobs, top_logprobs=req.top_logprobs,
                                           lora=req.loras[pi] if req.loras else None))
                self.seqs.append(responses.SeqOut(index=index, prompt_index=pi, rid=rid,
                                                  prompt_text=text, prompt_ids=tuple(ids)))
        # tool calls: what reads each choice's answer (None: plain text), streamed choices'
        # parse state
        self.tool_parser = st.tools.output_parser(req.tools) if req.route == "chat" else None
        self.tool_streams: dict[int, tools.ToolStream] = {}
        # reasoning: each choice's split (None: its output is not split)
        self.reasoning = [st.chat_options.reader(req, toks[s.prompt_index][1])
                          if req.route == "chat" else None for s in self.seqs]
        self.first: dict[int, float] = {}
        self.last: dict[int, float] = {}
        self._q: asyncio.Queue[tuple[int, Delta | APIError]] | None = None
        self.cut_error: APIError | None = None

    def rids(self) -> set[str]:
        """The rids this request holds while in flight: its base and its engine requests'."""
        return {self.base, *(g.rid for g in self.gen)}

    def cut(self, error: APIError) -> None:
        """End this request now with `error` (its unfinished engine requests are aborted)."""
        self.cut_error = error
        if self._q is not None:
            self._q.put_nowait((-1, error))

    def piece(self, tid: int) -> bytes:
        return self.st.engine.tokenizer.token_bytes(tid)

    def observe(self, i: int, d: Delta) -> None:
        """Metrics for one delta of sequence i."""
        m, now = self.st.metrics, time.monotonic()
        k = len(d.token_ids)
        if k:
            if i not in self.first:
                self.first[i] = now
                m.ttft.observe(now - self.t0)
            else:  # tokens arriving together share the gap since the previous delta
                gap = (now - self.last[i]) / k
                for _ in range(k):
                    m.itl.observe(gap)
            self.last[i] = now
        if d.finished and d.error is None:
            m.e2e.observe(now - self.t0)
            s = self.seqs[i]
            m.generation_tokens += s.completion_tokens
            if s.index % self.req.n == 0:  # a prompt counts once, not once per choice
                m.prompt_tokens += s.prompt_tokens
                m.cached_tokens += s.cached_tokens

    async def deltas(self) -> AsyncIterator[tuple[int, Delta]]:
        """Merged (sequence index, delta) stream; leaving it early aborts the unfinished."""
        q: asyncio.Queue[tuple[int, Delta | APIError]] = asyncio.Queue()
        self._q = q
        if self.cut_error is not None:
            raise self.cut_error
        done: set[int] = set()
        engine = self.st.engine

        async def pump(i: int, gr: GenRequest) -> None:
            try:
                it = engine.generate(gr)
                try:
                    async for d in it:
                        q.put_nowait((i, d))
                        if d.finished:
                            return
                finally:
                    await it.aclose()
                q.put_nowait((i, Delta.failed(gr.rid, i, "the engine ended the stream before "
                                              "the request finished")))
            except Refused as e:  # (an APIError is one)
                q.put_nowait((i, APIError.of(e)))
            except Exception as e:  # one failing request fails alone
                log.exception("request %r failed in the engine", gr.rid)
                q.put_nowait((i, Delta.failed(gr.rid, i, f"{type(e).__name__}: {e}")))

        tasks = [asyncio.create_task(pump(i, gr)) for i, gr in enumerate(self.gen)]
        try:
            while len(done) < len(self.gen):
                i, d = await q.get()
                if isinstance(d, APIError):
                    if i >= 0:  # refused by the engine: nothing of it to abort
                        done.add(i)
                    raise d
                if d.finished:
                    done.add(i)
                self.seqs[i].add(d)
                self.observe(i, d)
                yield i, d
        finally:
            for i, gr in enumerate(self.gen):
                if i not in done:
                    engine.abort(gr.rid)
            for t in tasks:
                t.cancel()

    def usage(self) -> JSONObject:
        return responses.usage(self.seqs, self.prompt_lens, self.st.args.enable_cache_report)


def _select_adapter(st: ServerState, req: ParsedRequest) -> None:
    """OpenAI's `model` names the served model or one of its LoRA adapters (an unknown name is
    404 model_not_found); /generate's lora_path names adapters (checked the same way)."""
    loras = st.engine.lora_adapters() if hasattr(st.engine, "lora_adapters") else None
    names = sorted(st.served_names | set(loras or ()))
    if req.route != "generate":
        if req.model is not None and req.model not in st.served_names:
            if loras is None or req.model not in loras:
                raise APIError(404, f"the model '{req.model}' does not exist; this server "
                               f"serves {', '.join(names)}", param="model",
                               code="model_not_found")
            req.loras = [req.model] * len(req.prompts)
        return
    if req.loras is None:
        return
    if loras is None:
        raise APIError(400, "lora_path names a LoRA adapter, but LoRA is off in this server "
                       "(start it with --enable-lora or --lora-paths)", param="lora_path",
                       code="unsupported")
    for name in req.loras:
        if name is not None and name not in loras:
            raise APIError(404, f"the LoRA adapter '{name}' is not loaded; loaded: "
                           f"{', '.join(sorted(loras)) or 'none'}", param="lora_path",
                           code="model_not_found")


async def handle(request: web.Request, route: str) -> web.StreamResponse:
    arrived = time.monotonic()
    st = state(request)
    st.refuse_if_draining()
    body = await st.read_json(request)
    eng = st.engine
    req = PARSERS[route](body, eng.vocab_size, eng.context_length)
    st.check_client_rid(req.rid)
    _select_adapter(st, req)
    if route == "chat":
        st.tools.prepare(req)  # tool_choice's constraint goes in before the engine checks it
        st.chat_options.prepare(req)  # reasoning fields, template kwargs
    _validate_sampling(st, req)
    with st.admitted(len(req.prompts) * req.n):
        toks = await asyncio.get_running_loop().run_in_executor(st.pool, _tokenize, st, req)
        job = _Job(st, req, toks, arrived)
        with st.reserved(job.rids(), job):  # 400 if a client rid is in use; nothing is touched
            if st.args.log_requests:  # %r: a rid or stop string cannot forge log lines
                log.info("request %r %s prompt_tokens=%s n=%d stream=%s sampling=%r", job.base,
                         route, job.prompt_lens, req.n, req.stream, job.gen[0].sampling)
            if req.stream:
                return await _stream(request, job)
            return await _complete(job)


async def _complete(job: _Job) -> web.Response:
    req = job.req
    async with contextlib.aclosing(job.deltas()) as evs:
        async for i, _d in evs:
            if job.seqs[i].error:
                raise APIError(500, f"generation failed: {job.seqs[i].error}",
                               code="engine_error")
    _log_done(job)
    if req.route == "generate":
        e2e = time.monotonic() - job.t0
        objs = [responses.generate_object(s, req, e2e, job.piece) for s in job.seqs]
        body: JSON = objs if (req.batch or req.n > 1) else objs[0]
    elif req.route == "chat":
        body = responses.chat_object(job.base, job.created, job.model, req, job.seqs,
                                     job.piece, job.usage(), job.tool_parser, job.reasoning)
    else:
        body = responses.completion_object(job.base, job.created, job.model, req, job.seqs,
                                           job.piece, job.usage())
    return web.Response(body=responses.dumps(body), content_type="application/json")


def _chunks(job: _Job, i: int, d: Delta) -> list[JSONObject]:
    """What to send for one delta of sequence i."""
    req, s = job.req, job.seqs[i]
    text, fin = d.text, s.finish_reason if d.finished else None
    entries = s.output_entries(len(s.token_ids) - len(d.token_ids)) if d.logprobs else []
    if req.route == "generate":
        if not (text or fin or entries):
            return []
        obj = responses.generate_object(s, req, time.monotonic() - job.t0 if fin else None,
                                        job.piece)
        if len(job.seqs) > 1:
            obj["index"] = s.index
        return [obj]
    if req.route == "chat":
        out = []
        if not s.started:
            s.started = True
            out.append(responses.chat_chunk(job.base, job.created, job.model, s.index,
                                            {"role": "assistant", "content": ""}, None, None))
            out[-1].update(responses.chat_prompt_fields(s, req, job.piece))
        lp = responses.chat_logprobs(entries, job.piece) if req.logprobs else None
        # return_token_ids: each delta's ids ride on its first chunk (vLLM's per-chunk
        # token_ids), on an empty delta where nothing else is sent, so none is lost
        ids = list(d.token_ids) if req.return_token_ids and d.token_ids else None
        split = job.reasoning[i]
        delta: JSONObject = {"content": text} if text else {}
        if split is not None:  # reasoning first; tool calls are read from the content
            delta = split.feed(text, fin is not None)
        if job.tool_parser is not None:
            thought = {k: v for k, v in delta.items() if k == "reasoning_content"}
            return out + _tool_chunks(job, i, fin, lp if entries else None, ids, thought)
        if delta or entries or fin or ids:
            out.append(responses.chat_chunk(job.base, job.created, job.model, s.index,
                                            delta, fin, lp))
            if req.return_token_ids:
                out[-1]["choices"][0]["token_ids"] = ids or []
        return out
    first = not s.started
    offset = len(s.full_text) - len(d.text)
    if first and req.echo:
        text = (s.prompt_text or "") + text
        offset = 0
        if req.logprobs:
            entries = responses.echo_entries(s, req.top_logprobs) + entries
    elif req.echo:
        offset += len(s.prompt_text or "")
    s.started = True
    extras = (first and (req.return_token_ids or req.prompt_logprobs is not None)) or (
        req.return_token_ids and d.token_ids)
    if not (text or entries or fin or extras):
        return []
    lp = None
    if req.logprobs:
        lp = responses.completion_logprobs(entries, job.piece, offset)
    chunk = responses.completion_chunk(job.base, job.created, job.model, s.index, text, fin, lp)
    choice = chunk["choices"][0]
    if req.return_token_ids:
        choice["token_ids"] = list(d.token_ids)
        if first:
            choice["prompt_token_ids"] = list(s.prompt_ids)
    if first and req.prompt_logprobs is not None and not (req.echo and req.logprobs):
        choice["prompt_logprobs"] = responses.vllm_prompt_logprobs(s, job.piece)
    return [chunk]


def _tool_chunks(job: _Job, i: int, fin: str | None, lp: JSONObject | None,
                 ids: list[int] | None = None, thought: JSONObject | None = None
                 ) -> list[JSONObject]:
    """Chunks of a choice whose answer is read for tool calls: the text so far re-parsed, what
    is new sent (content, a call's header, argument fragments); logprobs and the delta's
    token ids (return_token_ids) ride on the first chunk, the finish reason on the last.
    thought: the reasoning delta split off first (its own chunk, before them); the text
    read for calls is then the content split so far."""
    s = job.seqs[i]
    stream = job.tool_streams.get(i)
    if stream is None:
        stream = job.tool_streams[i] = tools.ToolStream(job.tool_parser, job.req.tools)
    split = job.reasoning[i]
    text = s.full_text if split is None else split.content
    deltas: list[JSONObject | tools.MessageDelta] = [thought] if thought else []
    deltas += stream.step(text, fin is not None)
    if fin == "stop" and stream.called:
        fin = "tool_calls"
    if fin is not None or lp is not None or ids:
        deltas = deltas or [{}]
    chunks = [responses.chat_chunk(job.base, job.created, job.model, s.index, d,
                                   fin if k == len(deltas) - 1 else None,
                                   lp if k == 0 else None)
              for k, d in enumerate(deltas)]
    if job.req.return_token_ids:
        for k, chunk in enumerate(chunks):
            chunk["choices"][0]["token_ids"] = (ids or []) if k == 0 else []
    return chunks


async def _stream(request: web.Request, job: _Job) -> web.StreamResponse:
    resp: web.StreamResponse | None = None

    async def start() -> web.StreamResponse:
        r = web.StreamResponse(headers=SSE_HEADERS)
        await r.prepare(request)
        return r

    try:
        try:
            async with contextlib.aclosing(job.deltas()) as evs:
                async for i, d in evs:
                    # headers go out with the first delta, so that a rejection before it (queue
                    # full, a request that can never fit) is still an HTTP status
                    if resp is None:
                        resp = await start()
                    if job.seqs[i].error:
                        request[OUTCOME] = "server_error"
                        err = APIError(500, f"generation failed: {job.seqs[i].error}",
                                       code="engine_error")
                        await resp.write(responses.sse(err.body()))
                        break
                    for chunk in _chunks(job, i, d):
                        await resp.write(responses.sse(chunk))
                else:
                    if job.req.include_usage:
                        obj = "chat.completion.chunk" if job.req.route == "chat" \
                            else "text_completion"
                        await resp.write(responses.sse(responses.usage_chunk(
                            job.base, job.created, job.model, obj, job.usage())))
                    _log_done(job)
        except APIError as e:
            if resp is None:
                raise
            request[OUTCOME] = "server_error" if e.status >= 500 else "client_error"
            await resp.write(responses.sse(e.body()))
        except (ConnectionResetError, asyncio.CancelledError):
            raise
        except Exception:  # a bug after the headers went out: end the stream in the error shape
            if resp is None:
                raise
            log.exception("stream %r failed", job.base)
            request[OUTCOME] = "server_error"
            await resp.write(responses.sse(APIError(500, "internal server error; see the "
                                                    "server log", code="internal_error").body()))
        if resp is None:
            resp = await start()
        await resp.write(responses.SSE_DONE)
        await resp.write_eof()
    except ConnectionResetError:  # the client went away; deltas() already aborted the rest
        request[OUTCOME] = "aborted"
        if job.st.args.log_requests:
            log.info("request %r: client disconnected, aborted", job.base)
    return resp


def _log_done(job: _Job) -> None:
    if job.st.args.log_requests:
        for s in job.seqs:
            log.info("finish %r reason=%s prompt_tokens=%d completion_tokens=%d cached=%d "
                     "e2e=%.3fs", s.rid, s.finish_reason, s.prompt_tokens, s.completion_tokens,
                     s.cached_tokens, time.monotonic() - job.t0)
