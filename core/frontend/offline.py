"""The offline API: `core.Engine(model_path=None, **server_args)`, then
`generate(prompt | [prompts] | input_ids=..., sampling_params=..., stream=False)`.

The plan is resolved here, once (and kept as `engine.plan`); the worker process that
`core.frontend.client.EngineClient` owns is given it as data and runs the model. The tokenizer is loaded
here for the client's text work; the worker loads its own (for EOS ids and stop strings). With
`dp_size` > 1 the client is a `core.frontend.router.ReplicaSet`: that many workers, the same interface.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Generator, Iterator
from typing import TYPE_CHECKING

from core.frontend.client import EngineClient, EngineError
from core.frontend.delta import Delta
from core.frontend.prestart import StartedWorker
from core.frontend.router import ReplicaSet
from core.messages import EngineInfo, SamplingParams, expand_n, to_json
from core.plan.args import ServerArgs, apply_environment, make_server_args, serving_defaults

if TYPE_CHECKING:
    from core.contract.json_types import JSONObject
    from core.tokenizer import Tokenizer

Prompts = str | list[str] | None
InputIds = list[int] | list[list[int]] | None
SamplingArg = SamplingParams | dict | list[dict] | None

__all__ = ["Engine", "EngineClient", "EngineError", "expand_n"]

log = logging.getLogger("core.frontend.offline")


def _as_list(value: Prompts | InputIds, kind: str) -> tuple[list, bool]:
    if value is None:
        return [], False
    if kind == "ids":
        if value and isinstance(value[0], list):
            return list(value), True
        return [value], False
    if isinstance(value, str):
        return [value], False
    if isinstance(value, list):
        return list(value), True
    raise ValueError(f"prompt must be a string or a list of strings, got {type(value).__name__}")


class Engine:
    """Offline engine: resolves the plan, loads the model in a worker process, generates.

    Engine(model_path=None, **server_args) takes ServerArgs fields as keywords (or
    server_args=ServerArgs(...)); with no model path it serves the embedded SmolLM2.
    serving=True: `core serve`'s defaults where they differ (core.plan.args.serving_defaults),
    for the device the plan chose. started: worker processes the caller spawned already
    (core.frontend.prestart.StartedWorker, one per replica), so their imports began earlier;
    the engine owns them from here (and stops them if it fails to start).
    """

    def __init__(self, model_path: str | None = None, *, server_args: ServerArgs | None = None,
                 serving: bool = False, started: list[StartedWorker] | None = None,
                 **kwargs: object):
        from core.engine.worker import make_plan
        from core.plan.prebuild import start_prebuilds
        from core.plan.resolver import explain

        # the workers import torch while this process resolves the plan (`started`: spawned
        # by the caller, earlier still; one per replica, else they are stopped and replaced);
        # whatever fails before the client takes them stops them
        try:
            if server_args is None:
                args = make_server_args(model_path=model_path, **kwargs)
            else:
                if kwargs:
                    raise ValueError("pass either server_args or keyword arguments, not both")
                args = apply_environment(server_args if model_path is None else
                                         server_args.replace(model_path=model_path))
            t0 = time.perf_counter()
            if started is not None and len(started) != args.dp_size:
                for worker in started:
                    worker.cancel()
                started = None
            if started is None:
                started = [StartedWorker(args) for _ in range(args.dp_size)]
            t1 = time.perf_counter()
            self.args, self.plan, self.spec, registry = make_plan(args)
            # C kernels compile beside the tokenizer and the worker's read-ahead
            start_prebuilds(self.plan, registry)
            if serving:  # `core serve`'s defaults, for the device the plan chose
                self.args = serving_defaults(self.args, self.plan.device.device_type)
            log.info("%s", explain(self.plan))
            t2 = time.perf_counter()
            self.tokenizer = _load_tokenizer(self.args)
        except BaseException:
            for worker in started or ():
                worker.cancel()
            raise
        t3 = time.perf_counter()
        self.client: EngineClient | ReplicaSet
        if args.dp_size > 1:  # data parallelism: one worker per replica, a router in front
            self.client = ReplicaSet(self.args, self.plan, self.tokenizer, started=started)
        else:
            self.client = EngineClient(self.args, self.plan, self.tokenizer, started=started[0])
        # this process's start-up, phase by phase (the engine process's own: info's); the
        # wait covers the worker's phases that did not overlap the plan and tokenizer
        self.startup_phases: tuple[tuple[str, float], ...] = (
            ("engine process(es) spawned", t1 - t0), ("plan resolved", t2 - t1),
            ("tokenizer loaded", t3 - t2),
            ("engine ready (waited for after the tokenizer)", time.perf_counter() - t3))
        self.info: EngineInfo = self.client.info  # what the worker built (its pid: replica 0's)
        # the LoRA adapters of one worker, name -> folder (a ReplicaSet keeps its replicas')
        self._loras: dict[str, str] | None = None
        if self.plan.lora_backend is not None and not isinstance(self.client, ReplicaSet):
            from core.plan.lora import adapter_specs

            self._loras = {s.name: s.path for s in adapter_specs(self.args)}
        self._lora_update = threading.Lock()  # an update and its record, one at a time
        for note in self.info.notes:  # KV sizing, graph capture: found at startup
            log.info("engine: %s", note)

    # -- generation ------------------------------------------------------------------------------

    def _submit_all(self, prompt: Prompts, input_ids: InputIds, sampling_params: SamplingArg,
                    priority: int | None, sink: Callable[[Delta], None],
                    lora_path: str | list[str | None] | None = None
                    ) -> tuple[list[str], bool]:
        if (prompt is None) == (input_ids is None):
            raise ValueError("give exactly one of prompt and input_ids")
        items, batched = _as_list(prompt if input_ids is None else input_ids,
                                  "text" if input_ids is None else "ids")
        if isinstance(sampling_params, list):
            if len(sampling_params) != len(items):
                raise ValueError(f"{len(sampling_params)} sampling_params for {len(items)} "
                                 f"prompts")
            sps = sampling_params
        else:
            sps = [sampling_params] * len(items)
        if isinstance(lora_path, list):
            if len(lora_path) != len(items):
                raise ValueError(f"{len(lora_path)} lora_path entries for {len(items)} prompts")
            loras = lora_path
        else:
            loras = [lora_path] * len(items)
        for name in loras:
            if name is not None and not isinstance(name, str):
                raise ValueError(f"lora_path must name a loaded adapter (a string), got {name!r}")
        prepared = []
        for item, sp, lora in zip(items, sps, loras, strict=True):
            params = SamplingParams.from_dict(sp)
            for sub in expand_n(params):
                text, ids = (None, item) if input_ids is not None else (item, None)
                prepared.append((*self.client.prepare(text, ids, sub), lora))
        rids: list[str] = []
        try:
            for i, (ids, sub, lora) in enumerate(prepared):
                rids.append(self.client.submit_prepared(ids, sub, priority=priority, sink=sink,
                                                        index=i, lora=lora))
        except BaseException:
            for rid in rids:
                self.client.abort(rid)
            raise
        return rids, batched or len(prepared) > 1

    def generate(self, prompt: str | list[str] | None = None,
                 sampling_params: dict | list[dict] | None = None, *,
                 input_ids: list[int] | list[list[int]] | None = None, stream: bool = False,
                 priority: int | None = None, lora_path: str | list[str | None] | None = None
                 ) -> JSONObject | list[JSONObject] | Iterator[JSONObject]:
        """Generate for one prompt (a dict) or a list (a list of dicts; n > 1 expands in place),
        in SGLang's shape: {"text", "output_ids", "meta_info": {"id", "finish_reason",
        "prompt_tokens", "completion_tokens", "cached_tokens"[, "output_token_logprobs",
        "output_top_logprobs"][, with speculative decoding: "spec_verify_ct" (verify steps
        with drafts), "spec_draft_tokens", "spec_accepted_tokens", or "spec_note" (why it was
        off for this request)]}}.

        stream=True returns an iterator of chunks in arrival order, each the same shape for
        what is new ("text", "token_ids" and the logprobs: new since the request's previous
        chunk) plus "rid" and "index" (the request's place in the batch).

        lora_path (SGLang's name): the loaded LoRA adapter serving the prompt, or one per prompt
        (None: the base model); an adapter that is not loaded finishes its request with an
        error.
        """
        q: queue.Queue[Delta] = queue.Queue()
        rids, batched = self._submit_all(prompt, input_ids, sampling_params, priority, q.put,
                                         lora_path)
        if stream:
            return self._chunks(self._stream(q, rids))
        texts: list[list[str]] = [[] for _ in rids]
        results: list[JSONObject] = [
            {"text": "", "output_ids": [], "meta_info": {}} for _ in rids]
        for d in self._stream(q, rids):
            texts[d.index].append(d.text)
            r = results[d.index]
            r["output_ids"] += d.token_ids
            _add_logprobs(r["meta_info"], d)
            if d.finished:
                r["meta_info"].update(_meta(d))
        for r, text in zip(results, texts, strict=True):
            r["text"] = "".join(text)
        return results if batched else results[0]

    @staticmethod
    def _chunks(deltas: Generator[Delta, None, None]) -> Iterator[JSONObject]:
        try:
            for d in deltas:
                yield sglang_chunk(d)
        finally:
            deltas.close()  # now, not when collected: it aborts what is unfinished

    def _stream(self, q: queue.Queue[Delta], rids: list[str]) -> Generator[Delta, None, None]:
        """Deltas of `rids` until all finish; a consumer that stops early aborts the rest."""
        open_ = set(rids)
        try:
            while open_:
                delta = q.get()
                if delta.error is not None:
                    raise EngineError(delta.error)
                if delta.finished:
                    open_.discard(delta.rid)
                yield delta
        finally:
            if open_ and self.client.health():
                for rid in open_:
                    self.client.abort(rid)

    def abort(self, rid: str) -> None:
        """Stop a request; its stream ends with finish_reason {"type": "abort"}."""
        self.client.abort(rid)

    # -- control ---------------------------------------------------------------------------------

    def stats(self, timeout: float = 60.0) -> JSONObject:
        """The scheduler's figures, answered between steps (EngineError after `timeout`)."""
        return self.client.stats(timeout)

    def heartbeat_stats(self) -> JSONObject | None:
        """The figures the worker published between its last steps (its latest heartbeat)."""
        beat = self.client.heartbeat
        return beat.stats if beat is not None else None

    def heartbeat_age(self) -> float:
        """Seconds since the worker's last heartbeat (sent every second, even mid-step)."""
        return self.client.heartbeat_age()

    def failure(self) -> str | None:
        """Why the worker is gone (it died or exited), or None while it runs."""
        if isinstance(self.client, ReplicaSet):  # any replica's (core.frontend.router says why)
            return self.client.failure()
        if self.client.dead_reason is not None:
            return self.client.dead_reason
        if not self.client.process.is_alive():
            return f"engine worker exited (exit code {self.client.process.exitcode})"
        return self.client.rank_failure()

    def check_accounting(self) -> None:
        self.client.check_accounting()

    def flush_cache(self) -> None:
        self.client.flush_cache()

    def lora_adapters(self) -> dict[str, str] | None:
        """The LoRA adapters requests may name (name -> folder); None with LoRA off."""
        if isinstance(self.client, ReplicaSet):  # those every replica holds
            return self.client.lora_adapters()
        return None if self._loras is None else dict(self._loras)

    def load_lora_adapter(self, lora_name: str, lora_path: str) -> JSONObject:
        """Load a PEFT adapter folder as `lora_name` while serving (SGLang's and vLLM's name);
        ValueError naming the problem (nothing changed) when it cannot be served. With
        --dp-size > 1 every replica loads it (core.frontend.router.ReplicaSet.update_lora)."""
        with self._lora_update:
            got = self.client.update_lora("load_lora", lora_name, lora_path)
            if self._loras is not None:
                self._loras[lora_name] = lora_path
        return got

    def unload_lora_adapter(self, lora_name: str) -> JSONObject:
        """Forget adapter `lora_name`; ValueError when it is not loaded or requests use it."""
        with self._lora_update:
            got = self.client.update_lora("unload_lora", lora_name)
            if self._loras is not None:
                self._loras.pop(lora_name, None)
        return got

    def health(self) -> bool:
        return self.client.health()

    def close(self) -> None:
        self.client.close()

    shutdown = close

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _meta(d: Delta) -> JSONObject:
    """SGLang's meta_info counts of a request, final on its last delta."""
    return {"id": d.rid, "finish_reason": None if d.finish is None else to_json(d.finish),
            "prompt_tokens": d.prompt_tokens, "completion_tokens": d.completion_tokens,
            "cached_tokens": d.cached_tokens, **(d.spec or {})}


def _add_logprobs(meta: JSONObject, d: Delta) -> None:
    """SGLang's output_token_logprobs ([logprob, token id] per token) and output_top_logprobs
    ([[logprob, token id], ...] per token), extended by one delta's."""
    if d.logprobs is None:
        return
    meta.setdefault("output_token_logprobs", []).extend(
        (lp.logprob, t) for t, lp in zip(d.token_ids, d.logprobs, strict=True))
    meta.setdefault("output_top_logprobs", []).extend(
        [(v, t) for t, v in lp.top] for lp in d.logprobs)


def sglang_chunk(d: Delta) -> JSONObject:
    """One streamed chunk of the offline API (Engine.generate(stream=True)) from a delta."""
    meta = _meta(d)
    _add_logprobs(meta, d)
    return {"rid": d.rid, "index": d.index, "text": d.text, "token_ids": list(d.token_ids),
            "finish_reason": meta["finish_reason"], "meta_info": meta}


def _load_tokenizer(args: ServerArgs) -> Tokenizer:
    """The same tokenizer the worker's loader uses."""
    from core.engine.loader import load_tokenizer

    tok = load_tokenizer(args)
    if tok is None:
        raise ValueError(f"no tokenizer for {args.model_path}; pass --tokenizer-path")
    return tok
