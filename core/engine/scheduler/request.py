"""What every scheduler manager shares: a request as the scheduler sees it (`Req`), the config,
the queues that hold requests between steps (`Queues`), and the admission error."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from core.engine.sampling import SamplingParams, SamplingState

if TYPE_CHECKING:
    from core.engine.memory.radix_cache import _Node
    from core.engine.sampling import PromptLogprobs, TokenLogprobs

CLIP_MAX_NEW_TOKENS = 4096  # reserve at most this many future tokens per request


class AdmissionError(ValueError):
    """A request that can never run (too long for the context or the pool, queue full...)."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


def check_fits(prompt_len: int, max_new_tokens: int, max_context: int, pool_tokens: int,
               page_size: int, groups: tuple[tuple[int, int], ...] = (),
               chunk: int | None = None) -> None:
    """Raise AdmissionError if such a request could never run, with the numbers.

    groups: (window, pool tokens) of a hybrid pool's windowed groups, where a request holds at
    most its window and a page, plus the extend in flight (`chunk` tokens at most, or its whole
    prompt without chunked prefill)."""
    if prompt_len < 1:
        raise AdmissionError("the prompt is empty")
    total = prompt_len + max_new_tokens
    if total > max_context:
        raise AdmissionError(
            f"prompt of {prompt_len} tokens + max_new_tokens {max_new_tokens} = {total} "
            f"exceeds the context length {max_context}")
    need = -(-total // page_size) * page_size
    if need > pool_tokens:
        raise AdmissionError(
            f"prompt of {prompt_len} tokens + max_new_tokens {max_new_tokens} needs {need} KV "
            f"tokens; the KV pool holds {pool_tokens} (raise --max-total-tokens or "
            f"--mem-fraction-static)")
    for window, tokens in groups:
        peak = min(total, window + 2 * page_size + min(prompt_len, chunk or prompt_len))
        need = -(-peak // page_size) * page_size
        if need > tokens:
            raise AdmissionError(
                f"prompt of {prompt_len} tokens + max_new_tokens {max_new_tokens} needs {need} KV "
                f"tokens in the window-{window} layers' pool, which holds {tokens} (raise "
                f"--swa-full-tokens-ratio or --max-total-tokens)")


@dataclass
class SchedulerConfig:
    page_size: int
    max_context: int
    max_running_requests: int
    max_queued_requests: int | None = None
    chunked_prefill_size: int | None = None  # None: no chunking
    max_prefill_tokens: int = 16384
    schedule_policy: str = "fcfs"
    enable_priority_scheduling: bool = False
    # a waiting request preempts running ones whose priority is lower by at least this much
    priority_preemption_threshold: int = 10
    schedule_conservativeness: float = 1.0
    seed: int = 0
    overlap: bool = False  # launch decode step N+1 before the host sees step N's tokens
    jump_forward: bool = False  # append grammar-forced tokens, computed by one extend
    spec_draft_tokens: int = 0  # speculative decoding: most drafts per request and step
    spec_governor: bool = False  # drafts cut per request and step where they do not pay
    spec_disable_batch: int | None = None  # no drafts in a step with more running requests
    # the prefill budget (core.engine.scheduler.budget): target ms of a step while requests
    # decode; None or 0: off (the chunk, always)
    decode_itl_target_ms: float | None = None


@dataclass
class Req:
    """A request as the scheduler sees it (token ids only; text lives with the client)."""

    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    state: SamplingState
    seq: int  # arrival order
    priority: int = 0
    output_ids: list[int] = field(default_factory=list)
    # KV memory
    row: int = -1  # req_to_token row while admitted
    pages: list[int] = field(default_factory=list)  # covers tokens [0, kv_len)
    num_shared: int = 0  # leading pages owned by the prefix cache (locked through `node`)
    # a hybrid KV pool's windowed groups 1..: pages positional like `pages`, the group's dummy
    # page where given back (out of the window); and how many leading pages were looked at
    wpages: list[list[int]] = field(default_factory=list)
    wtrimmed: list[int] = field(default_factory=list)
    node: _Node | None = None
    kv_len: int = 0  # tokens whose K/V is in the pool
    fill_len: int = 0  # tokens to cache before the next sample (prompt + output at admission)
    cached_tokens: int = -1  # prefix-cache hit of the first admission (reported)
    compile_id: int | None = None  # its grammar's compile while it is in `compiling`
    jumps: int = 0  # jump-forwards so far (an overlap step launched before one drops its token)
    jumping: bool = False  # in `jumped`: its forced tokens wait for their extend
    finish: dict | None = None
    # output not yet reported: new ids and their logprobs
    pending_ids: list[int] = field(default_factory=list)
    pending_lps: list[TokenLogprobs] = field(default_factory=list)
    # prompt_logprobs: (logprob, top, rank) of prompt tokens 1.. as prefill computes them;
    # reported once, with the first output
    prompt_lps: list[PromptLogprobs] = field(default_factory=list)
    prompt_lps_sent: bool = False
    # speculative decoding (core.engine.scheduler.spec): drafts verified, accepted, verify
    # steps with drafts; a note when speculation is off for this request (and why)
    spec_drafts: int = 0
    spec_accepted: int = 0
    spec_verify_steps: int = 0
    spec_note: str | None = None
    # LoRA: the adapter's load id (None: the base model; it keys the prefix cache) and the
    # device slot it holds while admitted (-1: none, or the base model)
    lora_id: int | None = None
    lora_slot: int = -1

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def remaining_new(self) -> int:
        return self.params.max_new_tokens - len(self.output_ids)

    @property
    def wants_prompt_lps(self) -> bool:
        """Prompt logprobs asked for and not all computed yet (the prefill must not start from
        a cached prefix: its positions' logits are needed)."""
        return (self.params.prompt_logprobs is not None
                and len(self.prompt_lps) < len(self.prompt_ids) - 1)


@dataclass
class Queues:
    """Where each live request is between steps (exactly one place each): waiting for
    admission, in the decode batch (`running`), being prefilled in chunks (`chunked`), waiting
    for the extend of its jump-forward tokens (`jumped`), or waiting for its grammar's compile
    (`compiling`, core.engine.scheduler.compiles). `by_id` holds them all until they finish."""

    waiting: list[Req] = field(default_factory=list)
    running: list[Req] = field(default_factory=list)
    chunked: Req | None = None
    jumped: list[Req] = field(default_factory=list)
    compiling: list[Req] = field(default_factory=list)
    by_id: dict[str, Req] = field(default_factory=dict)

    def holding(self) -> list[Req]:
        """The requests that hold a row and KV pages: running, jumped, the chunked one."""
        return self.running + self.jumped + ([self.chunked] if self.chunked else [])

    def unjump(self, r: Req) -> None:
        r.jumping = False
        self.jumped = [x for x in self.jumped if x is not r]

    def decoding(self, reqs: list[Req]) -> list[Req]:
        """Those of `reqs` that go on decoding: not finished, not waiting for a jump's extend."""
        return [r for r in reqs if r.finish is None and not r.jumping]


def new_counters() -> dict[str, int]:
    """The scheduler's event counts (its stats), shared by its managers."""
    return {"retractions": 0, "rejected": 0, "prefill_tokens": 0, "decode_tokens": 0,
            "cached_tokens": 0, "finished": 0, "aborted": 0, "steps": 0,
            "overlapped_steps": 0, "preemptions": 0, "jumps": 0, "jump_tokens": 0}
