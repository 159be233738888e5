"""The server's view of an engine: a small protocol the HTTP layer is written against.

The real engine is `core.frontend.serving.AsyncEngine` (over core.frontend.offline.Engine); tests
use `conformance.server_kit.FakeEngine`. A request is a `core.frontend.serving.GenRequest`.

Output. `EngineLike.generate(req)` yields `core.frontend.delta.Delta`s, one per step that
produced output for the request: its new text and token ids (and their logprobs when
`req.logprobs`; the prompt's on the first delta when the sampling asks for `prompt_logprobs`),
and on the last one its `finish` and final token counts. A request that fails inside the engine
ends with a delta carrying `error`, or the iterator raises; either way only that request fails.
Rejections that are the client's or the load's fault (queue full, prompt can never fit) raise
`core.frontend.refusal.Refused` (a `core.server.errors.APIError` is one) before the first delta.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from core.frontend.delta import Delta
from core.frontend.serving import GenRequest

__all__ = ["EngineLike", "GenRequest", "TokenizerLike"]

if TYPE_CHECKING:
    from core.contract.json_types import JSON, JSONObject


@runtime_checkable
class TokenizerLike(Protocol):
    """Text <-> token ids, and the chat template (core.tokenizer.Tokenizer is one). Called from
    a worker thread, never the loop. The ids the model accepts are EngineLike.vocab_size (a
    model's embedding may have more rows than its tokenizer has tokens)."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    # texts of the special (control) tokens, e.g. "<|im_start|>": chat content must not spell them
    special_tokens: Sequence[str]
    # the Jinja chat template's text (--chat-template's when given), None when unknown (tool
    # calling reads whether it uses `tools`: core.server.tools)
    chat_template: str | None

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (logprobs' `bytes`; part of a character may be all a
        token holds, so this is not `decode([token_id])`)."""
        ...

    def apply_chat_template(self, messages: list[JSONObject], *,
                            add_generation_prompt: bool = True,
                            tools: list[JSONObject] | None = None,
                            **template_vars: JSON) -> str:
        """Render messages to the prompt text; raises ValueError for a conversation it refuses.
        tools: the request's tools (OpenAI's shape), given only when there are some, for the
        template's `tools` (as HF's apply_chat_template passes them). template_vars: a
        request's chat_template_kwargs, extra template variables (Qwen3's enable_thinking),
        as HF's apply_chat_template takes them."""
        ...


@runtime_checkable
class EngineLike(Protocol):
    """What the HTTP layer needs from an engine. Every method is cheap or async: none of them may
    run model code on the caller's thread (the server's event loop)."""

    tokenizer: TokenizerLike
    vocab_size: int  # the model's: token ids in [0, vocab_size) are accepted
    model_name: str  # default served model name
    context_length: int  # most tokens (prompt + output) in one sequence

    def plan_dict(self) -> JSONObject | None:
        """The resolved plan as `Plan.to_dict()` (candidates included), or None if unknown."""
        ...

    def describe_plan(self) -> str:
        """The plan as the human-readable table `core.plan.resolver.explain` prints ("" if none)."""
        ...

    def model_info(self) -> JSONObject:
        """Static facts: model_path, tokenizer_path, architecture, ... (JSON-able)."""
        ...

    def validate_sampling(self, sampling: JSONObject) -> None:
        """Raise ValueError naming the parameter if the engine would refuse these values."""
        ...

    def generate(self, req: GenRequest) -> AsyncGenerator[Delta, None]:
        """Submit and stream deltas (see module docstring). Closing the generator early
        aborts the request."""
        ...

    def abort(self, rid: str) -> None:
        """Abort a request (no-op if unknown or finished); returns at once, frees its KV pages."""
        ...

    async def health(self) -> bool:
        """Liveness: True while the engine process is alive and beating, busy or not. It must not
        wait for a scheduler step to end (one step may take many seconds)."""
        ...

    def failure(self) -> str | None:
        """Why the engine is gone for good (its process died), or None while it runs. The
        server exits non-zero when this turns non-None, so that a supervisor restarts it."""
        ...

    async def stats(self) -> JSONObject:
        """Live figures: num_running_reqs, num_queued_reqs, kv_pages_used, kv_pages_total,
        prefix_cache_hit_rate (0..1) -- any key may be missing."""
        ...

    async def shutdown(self) -> None:
        """Stop the engine and every process it started."""
        ...
