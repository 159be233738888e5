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
from collections.abc import Callable, Iterator
from typing import Any

from core.engine.sampling import SamplingParams, expand_n
from core.frontend.client import Chunk, EngineClient, EngineError, StartedWorker
from core.frontend.router import ReplicaSet
from core.messages import to_json
from core.plan.args import ServerArgs, apply_environment, make_server_args

__all__ = ["Engine", "EngineClient", "EngineError", "expand_n"]

log = logging.getLogger("core.frontend.offline")


def _as_list(value: Any, kind: str) -> tuple[list, bool]:
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
    """

    def __init__(self, model_path: str | None = None, *, server_args: ServerArgs | None = None,
                 **kwargs: Any):
        from core.engine.worker import make_plan
        from core.plan.resolver import explain

        if server_args is None:
            args = make_server_args(model_path=model_path, **kwargs)
        else:
            if kwargs:
                raise ValueError("pass either server_args or keyword arguments, not both")
            args = apply_environment(server_args if model_path is None else
                                     server_args.replace(model_path=model_path))
        # the workers import torch while this process resolves the plan
        started = [StartedWorker() for _ in range(args.dp_size)]
        try:
            self.args, self.plan, self.spec, _ = make_plan(args)
            log.info("%s", explain(self.plan))
            self.tokenizer = _load_tokenizer(self.args)
        except BaseException:
            for worker in started:
                worker.cancel()
            raise
        self.client: EngineClient | ReplicaSet
        if args.dp_size > 1:  # data parallelism: one worker per replica, a router in front
            self.client = ReplicaSet(self.args, self.plan, self.tokenizer, started=started)
        else:
            self.client = EngineClient(self.args, self.plan, self.tokenizer, started=started[0])
        self.info: dict[str, Any] = to_json(self.client.info)  # core.messages.EngineInfo's fields
        for note in self.info["notes"]:  # KV sizing, graph capture: found at startup
            log.info("engine: %s", note)

    # -- generation ------------------------------------------------------------------------------

    def _submit_all(self, prompt: Any, input_ids: Any, sampling_params: Any,
                    priority: int | None, sink: Callable[[Chunk], None]
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
        prepared = []
        for item, sp in zip(items, sps, strict=True):
            params = SamplingParams.from_dict(sp)
            for sub in expand_n(params):
                text, ids = (None, item) if input_ids is not None else (item, None)
                prepared.append(self.client.prepare(text, ids, sub))
        rids: list[str] = []
        try:
            for i, (ids, sub) in enumerate(prepared):
                rids.append(self.client.submit_prepared(ids, sub, priority=priority, sink=sink,
                                                        index=i))
        except BaseException:
            for rid in rids:
                self.client.abort(rid)
            raise
        return rids, batched or len(prepared) > 1

    def generate(self, prompt: str | list[str] | None = None,
                 sampling_params: dict | list[dict] | None = None, *,
                 input_ids: list[int] | list[list[int]] | None = None, stream: bool = False,
                 priority: int | None = None) -> Any:
        """Generate for one prompt (a dict) or a list (a list of dicts; n > 1 expands in place).

        stream=True returns an iterator of chunks {"index", "text" (delta), "token_ids" (new),
        "finish_reason", "meta_info"} in arrival order.
        """
        q: queue.Queue = queue.Queue()
        rids, batched = self._submit_all(prompt, input_ids, sampling_params, priority, q.put)
        if stream:
            return self._stream(q, rids)
        results: list[dict[str, Any]] = [
            {"text": "", "output_ids": [], "meta_info": {}} for _ in rids]
        for chunk in self._stream(q, rids):
            r = results[chunk["index"]]
            r["text"] += chunk["text"]
            r["output_ids"] += chunk["token_ids"]
            meta = r["meta_info"]
            meta.update(chunk["meta_info"])
            meta["finish_reason"] = chunk["finish_reason"]
            if "logprobs" in chunk:
                meta.setdefault("output_token_logprobs", []).extend(
                    (x["logprob"], x["token_id"]) for x in chunk["logprobs"])
                meta.setdefault("output_top_logprobs", []).extend(
                    [(lp, t) for t, lp in x["top_logprobs"]] for x in chunk["logprobs"])
        return results if batched else results[0]

    def _stream(self, q: queue.Queue, rids: list[str]) -> Iterator[Chunk]:
        """Chunks of `rids` until all finish; a consumer that stops early aborts the rest."""
        open_ = set(rids)
        try:
            while open_:
                chunk = q.get()
                if "error" in chunk:
                    raise EngineError(chunk["error"])
                if chunk["finish_reason"] is not None:
                    open_.discard(chunk["rid"])
                yield chunk
        finally:
            if open_ and self.client.health():
                for rid in open_:
                    self.client.abort(rid)

    def submit(self, input_ids: list[int], sampling_params: dict | SamplingParams | None, *,
               sink: Callable[[Chunk], None], rid: str | None = None,
               priority: int | None = None) -> str:
        """Queue one request (n = 1) whose chunks go to `sink` (called on the client's reader
        thread); returns its id. Raises ValueError for what cannot run, EngineError when the
        engine is gone."""
        return self.client.submit(None, sampling_params, input_ids=input_ids, rid=rid,
                                  priority=priority, sink=sink)

    def abort(self, rid: str) -> None:
        """Stop a request; its stream ends with finish_reason {"type": "abort"}."""
        self.client.abort(rid)

    # -- control ---------------------------------------------------------------------------------

    def stats(self, timeout: float = 60.0) -> dict[str, Any]:
        """The scheduler's figures, answered between steps (EngineError after `timeout`)."""
        return self.client.rpc("stats", timeout)

    def heartbeat_stats(self) -> dict[str, Any] | None:
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

    def health(self) -> bool:
        return self.client.health()

    def close(self) -> None:
        self.client.close()

    shutdown = close

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _load_tokenizer(args: ServerArgs) -> Any:
    """The same tokenizer the worker's loader uses."""
    from core.engine.loader import load_tokenizer

    tok = load_tokenizer(args)
    if tok is None:
        raise ValueError(f"no tokenizer for {args.model_path}; pass --tokenizer-path")
    return tok
