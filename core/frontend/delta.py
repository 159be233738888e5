"""What the engine client hands its callers, one per request and step that produced output:
the `Delta`. It is the second of the four output shapes (the worker's `core.messages.
OutputItem` -> `Delta` -> a response object (OpenAI's, SGLang's) -> JSON); the client makes it
from an OutputItem once the text is detokenized and stop strings are cut, and the server and
the offline `Engine` read it, typed, to build their responses.
"""

from __future__ import annotations

from dataclasses import dataclass

from core.messages import Finish, TokenLogprob


@dataclass(frozen=True, slots=True)
class Delta:
    """A request's new output since its previous delta.

    text / token_ids: new since the previous delta (text may be "" while a possible stop
    string is held back). logprobs: one per token id, when the request asked for them.
    prompt_logprobs: one per prompt token after the first, on the request's first delta only,
    when asked for. finish: on the last delta, why it ended (an abort carries its message and,
    when the engine refused the request, the HTTP status); the token counts are final then.
    error: the engine failed (the worker, a rank or a replica died, or the client closed):
    the request ends with this delta, finish an abort that says the same."""

    rid: str
    index: int  # the caller's index of this request among those it submitted together
    text: str
    token_ids: tuple[int, ...]
    finish: Finish | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    logprobs: tuple[TokenLogprob, ...] | None = None
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None
    error: str | None = None
    # speculative decoding's per-request counts, on the last delta (OutputItem's spec_*)
    spec: dict[str, int | str] | None = None

    @property
    def finished(self) -> bool:
        return self.finish is not None

    @staticmethod
    def failed(rid: str, index: int, reason: str) -> Delta:
        """The last delta of a request the engine can no longer run."""
        return Delta(rid, index, "", (), Finish("abort", message=reason), error=reason)
