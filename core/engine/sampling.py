"""The batched sampler that runs on the device, and each request's sampler state. The sampling
parameters (validated, SGLang's names) are core.messages.SamplingParams, re-exported here.

Order of operations per step, per request: repetition / frequency / presence penalties,
logit_bias (added to the logits, OpenAI's semantics), min_new_tokens (stop tokens masked), a grammar's token bitmask (structured output,
core.contract.grammar) for constrained requests, then greedy argmax when temperature == 0, else temperature,
top-k, top-p, min-p and a draw. A request with a seed draws from its own torch.Generator, so the
same seed gives the same tokens whatever else is in the batch. Logprobs are those of the model's
distribution (log-softmax of the raw logits), like vLLM's default. prompt_logprobs asks for
the logprob of every prompt token after the first (and its top alternatives) from the prefill's
logits (the scheduler computes them; such a request does not reuse a cached prefix).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from core.contract.grammar import apply_bitmask
from core.messages import (  # noqa: F401 - their old home: importers keep these names
    LOGIT_BIAS_LIMIT,
    MAX_LOGIT_BIAS,
    MAX_TOP_LOGPROBS,
    SamplingParams,
    expand_n,
)

if TYPE_CHECKING:
    from collections.abc import Callable
    from concurrent.futures import Future, ThreadPoolExecutor
    from typing import TypeAlias

    from core.contract.grammar import GrammarMatcher

    # one token's (logprob, [(token, logprob) of its top alternatives]), as sampling reports it
    TokenLogprobs: TypeAlias = tuple[float, list[tuple[int, float]]]
    # a prompt token's: the same and its rank (token_logprobs)
    PromptLogprobs: TypeAlias = tuple[float, list[tuple[int, float]], int]


class SamplingState:
    """One request's sampler state on the device, kept across steps (and across retraction)."""

    def __init__(self, params: SamplingParams, prompt_ids: list[int], stop_ids: list[int],
                 vocab_size: int, device: torch.device):
        self.params = params
        self.stop_ids = stop_ids  # masked while fewer than min_new_tokens were produced
        self.num_out = 0
        # the request's grammar matcher (core.contract.grammar.GrammarMatcher), set at admission
        self.matcher: GrammarMatcher | None = None
        self.generator: torch.Generator | None = None
        if params.seed is not None and not params.greedy:
            self.generator = torch.Generator(device=device)
            # a negative seed names the generator state of its two's-complement bit pattern
            self.generator.manual_seed(params.seed % 2**64)
        self.counts: torch.Tensor | None = None  # [V] output-token counts (freq/presence)
        self.seen: torch.Tensor | None = None  # [V] prompt or output token (repetition)
        if params.frequency_penalty or params.presence_penalty:
            self.counts = torch.zeros(vocab_size, dtype=torch.float32, device=device)
        if params.repetition_penalty != 1.0:
            self.seen = torch.zeros(vocab_size, dtype=torch.bool, device=device)
            ids = [t for t in prompt_ids if t < vocab_size]
            self.seen[torch.tensor(ids, dtype=torch.long, device=device)] = True
        self.bias: tuple[torch.Tensor, torch.Tensor] | None = None  # (ids, biases)
        if params.logit_bias:
            items = sorted(params.logit_bias.items())
            self.bias = (torch.tensor([t for t, _ in items], dtype=torch.long, device=device),
                         torch.tensor([float(b) for _, b in items], dtype=torch.float32,
                                      device=device))

    def observe(self, token: int) -> None:
        self.num_out += 1
        if self.counts is not None:
            self.counts[token] += 1
        if self.seen is not None:
            self.seen[token] = True


@dataclass
class SampleOutput:
    tokens: list[int]
    # per request: (logprob of the chosen token, [(token, logprob), ...]) or None
    logprobs: list[tuple[float, list[tuple[int, float]]] | None]


class MaskJob:
    """The grammar masks of one step's constrained rows, filled on a host thread while the
    step's forward runs (Sampler.start_masks); `wait()` gives (bitmask, rows)."""

    def __init__(self, future: Future[float], bitmask: torch.Tensor, rows: list[int]):
        self.future, self.bitmask, self.rows = future, bitmask, rows

    def wait(self) -> tuple[torch.Tensor, list[int]]:
        self.future.result()  # re-raises a backend's error here, in the scheduler's thread
        return self.bitmask, self.rows


class Sampler:
    """Batched sampling over [B, V] fp32 logits with per-request states."""

    def __init__(self, device: torch.device, seed: int = 0,
                 to_device: Callable[[torch.Tensor, torch.device], torch.Tensor] | None = None):
        """to_device(host, device): the Platform's host-to-device copy (grammar masks go
        through it: pinned and non-blocking on a GPU); None: a plain `.to`."""
        self.device = device
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        self._move = (lambda t: to_device(t, device)) if to_device is not None else None
        # one host thread for grammar masks, made on first use
        self._pool: ThreadPoolExecutor | None = None
        # seconds spent filling grammar masks, and of those the scheduler waited for (the
        # rest ran behind the forward); mask_fills: masks filled
        self.mask_stats = {"mask_fill_s": 0.0, "mask_wait_s": 0.0, "mask_fills": 0}

    def start_masks(self, states: list[SamplingState], vocab_size: int) -> MaskJob | None:
        """Begin filling the constrained rows' grammar masks on a host thread (None: no row is
        constrained). Call before the step's forward and pass the job to `sample`; nothing may
        touch those matchers until then (the scheduler accepts tokens after sampling)."""
        rows = [i for i, s in enumerate(states) if s.matcher is not None]
        if not rows:
            return None
        if self._pool is None:
            from concurrent.futures import ThreadPoolExecutor

            self._pool = ThreadPoolExecutor(1, thread_name_prefix="core-grammar-mask")
        bitmask = torch.full((len(rows), -(-vocab_size // 32)), -1, dtype=torch.int32)
        matchers = [states[i].matcher for i in rows]
        return MaskJob(self._pool.submit(self._fill, matchers, bitmask), bitmask, rows)

    def _fill(self, matchers: list[GrammarMatcher], bitmask: torch.Tensor) -> float:
        t = time.perf_counter()
        for j, m in enumerate(matchers):
            m.fill_bitmask(bitmask, j)
        took = time.perf_counter() - t
        self.mask_stats["mask_fill_s"] += took
        self.mask_stats["mask_fills"] += len(matchers)
        return took

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, states: list[SamplingState],
               masks: MaskJob | None = None) -> SampleOutput:
        """masks: the step's grammar masks begun by start_masks (else filled here)."""
        B, V = logits.shape
        want_lp = [i for i, s in enumerate(states) if s.params.logprobs]
        raw = logits[want_lp].clone() if want_lp else None
        tokens = self.launch(logits, states, masks)
        token_list = tokens.tolist()  # the step's one host sync
        for s, t in zip(states, token_list, strict=True):
            s.observe(t)
        lps: list[TokenLogprobs | None] = [None] * B
        if want_lp:
            lps_rows = self._logprobs(raw, tokens[want_lp], [states[i] for i in want_lp])
            for i, lp in zip(want_lp, lps_rows, strict=True):
                lps[i] = lp
        return SampleOutput(token_list, lps)

    @torch.inference_mode()
    def launch(self, logits: torch.Tensor, states: list[SamplingState],
               masks: MaskJob | None = None, live: list[bool] | None = None) -> torch.Tensor:
        """The chosen tokens [B] as a device tensor, without waiting for them (no host sync).
        Penalty states are not updated: callers that defer the host copy (the overlap
        scheduler) use it only for `deferrable` states and call `observe` once tokens land.
        live[i] False: row i gets no grammar mask (a finished request; its token is dropped)."""
        if masks is not None:
            t = time.perf_counter()
            bitmask, rows = masks.wait()
            self.mask_stats["mask_wait_s"] += time.perf_counter() - t
            apply_bitmask(logits, bitmask, rows, self._move)
        else:
            self._constrain(logits, states, live)
        self._penalize(logits, states)
        greedy = [s.params.greedy for s in states]
        if all(greedy):
            return logits.argmax(dim=-1)
        return self._draw(logits, states, greedy)

    @staticmethod
    def deferrable(state: SamplingState, produced: int) -> bool:
        """Can this request's next token be drawn before its previous one reached the host?
        Yes unless something in the draw depends on the previous token: penalties (their
        counts), min_new_tokens still masking stop tokens, or logprobs (kept simple: sync).
        A grammar's mask does too, but the overlap schedule lands the previous step before
        it samples a constrained batch (core.engine.scheduler.overlap), so a grammar defers."""
        p = state.params
        return (state.counts is None and state.seen is None and not p.logprobs
                and produced >= p.min_new_tokens)

    def _constrain(self, logits: torch.Tensor, states: list[SamplingState],
                   live: list[bool] | None = None) -> None:
        """Mask what each constrained request's grammar forbids next, filled on the host in
        this thread (counted as waited for: on a device, the queued forward runs meanwhile)."""
        rows = [i for i, s in enumerate(states) if s.matcher is not None
                and (live is None or live[i])]
        if not rows:
            return
        bitmask = torch.full((len(rows), -(-logits.shape[1] // 32)), -1, dtype=torch.int32)
        self.mask_stats["mask_wait_s"] += self._fill([states[i].matcher for i in rows], bitmask)
        apply_bitmask(logits, bitmask, rows, self._move)

    def _penalize(self, logits: torch.Tensor, states: list[SamplingState]) -> None:
        for i, s in enumerate(states):
            p = s.params
            if s.seen is not None:
                row = logits[i]
                rp = p.repetition_penalty
                # HF / SGLang semantics: shrink positive logits, push negative ones further down.
                logits[i] = torch.where(s.seen, torch.where(row > 0, row / rp, row * rp), row)
            if s.counts is not None:
                logits[i] -= p.frequency_penalty * s.counts + p.presence_penalty * (s.counts > 0)
            if s.bias is not None:
                logits[i].index_add_(0, s.bias[0], s.bias[1])
            if s.num_out < p.min_new_tokens and s.stop_ids:
                logits[i, s.stop_ids] = float("-inf")

    def _filtered(self, logits: torch.Tensor, states: list[SamplingState],
                  greedy: list[bool]) -> torch.Tensor:
        """The processed distribution rows [B, V]: softmax at each request's temperature, with
        what top-k, top-p and min-p drop set to 0 (not renormalized)."""
        dev = logits.device
        temps = torch.tensor([s.params.temperature if not g else 1.0
                              for s, g in zip(states, greedy, strict=True)], device=dev)
        probs = torch.softmax(logits / temps[:, None], dim=-1)  # [B, V]
        ks = [s.params.top_k for s in states]
        ps = [s.params.top_p for s in states]
        mps = [s.params.min_p for s in states]
        if any(k > 0 for k in ks) or any(p < 1.0 for p in ps) or any(m > 0 for m in mps):
            sorted_p, idx = probs.sort(dim=-1, descending=True)  # [B, V] each
            rank = torch.arange(sorted_p.shape[1], device=dev)[None, :]
            k = torch.tensor([k if k > 0 else sorted_p.shape[1] for k in ks], device=dev)
            drop = rank >= k[:, None]
            cum_before = sorted_p.cumsum(dim=-1) - sorted_p  # mass strictly above each token
            drop |= cum_before > torch.tensor(ps, device=dev)[:, None]
            drop |= sorted_p < sorted_p[:, :1] * torch.tensor(mps, device=dev)[:, None]
            sorted_p = sorted_p.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter_(1, idx, sorted_p)
        return probs

    def _race(self, probs: torch.Tensor, states: list[SamplingState]) -> torch.Tensor:
        """One draw per row of (unnormalized) probs [B, V] -> [B], from each request's own
        generator where it has one, else the shared one."""
        dev = probs.device
        # Exponential race: argmax(p / E) with E ~ Exp(1) draws from p (no normalization needed).
        noise = torch.empty_like(probs)
        shared = [i for i, s in enumerate(states) if s.generator is None]
        if shared:
            noise[shared] = torch.empty(len(shared), probs.shape[1], device=dev).exponential_(
                generator=self.generator)
        for i, s in enumerate(states):
            if s.generator is not None:
                noise[i].exponential_(generator=s.generator)
        noise.clamp_(min=torch.finfo(noise.dtype).tiny)  # a 0 draw would divide to inf / nan
        return (probs / noise).argmax(dim=-1)

    def _draw(self, logits: torch.Tensor, states: list[SamplingState],
              greedy: list[bool]) -> torch.Tensor:
        drawn = self._race(self._filtered(logits, states, greedy), states)
        if any(greedy):
            g = torch.tensor(greedy, device=logits.device)
            drawn = torch.where(g, logits.argmax(dim=-1), drawn)
        return drawn

    @torch.inference_mode()
    def verify(self, logits: torch.Tensor, states: list[SamplingState],
               drafts: list[int | None]) -> tuple[list[int], list[bool],
                                                  list[TokenLogprobs | None]]:
        """Speculative verification of one draft position per row: logits [B, V] are the
        target's at that position (each request's earlier drafts already observed). Row i's
        logits go through exactly what `sample` applies (grammar mask, penalties, logit_bias,
        min_new_tokens, temperature, top-k/p, min-p). Greedy: the argmax, the draft accepted
        when equal. Sampled: the draft x (a deterministic proposal, so q is one-hot) is accepted
        with probability p(x); else a token is drawn from p with x removed, renormalized, which
        keeps the output distribution exactly p. drafts[i] None: a plain draw (the bonus token
        after accepted drafts). Returns (tokens, accepted, logprobs of the raw distribution)."""
        B = logits.shape[0]
        want_lp = [i for i, s in enumerate(states) if s.params.logprobs]
        raw = logits[want_lp].clone() if want_lp else None
        self._constrain(logits, states)
        self._penalize(logits, states)
        greedy = [s.params.greedy for s in states]
        tokens = logits.argmax(dim=-1).tolist()
        accepted = [d is not None and g and t == d
                    for t, d, g in zip(tokens, drafts, greedy, strict=True)]
        sampled = [i for i in range(B) if not greedy[i]]
        if sampled:
            sub = [states[i] for i in sampled]
            probs = self._filtered(logits[sampled], sub, [False] * len(sampled))
            probs = probs / probs.sum(dim=-1, keepdim=True)
            for j, i in enumerate(sampled):
                x = drafts[i]
                if x is None:
                    continue
                gen = states[i].generator or self.generator
                u = torch.rand((), generator=gen, device=probs.device)
                if bool(u < probs[j, x]):
                    accepted[i], tokens[i] = True, x
                else:  # the residual max(p - q, 0) with q one-hot at x: p without x
                    probs[j, x] = 0.0
            todo = [j for j, i in enumerate(sampled) if not accepted[i]]
            if todo:
                drawn = self._race(probs[todo], [sub[j] for j in todo]).tolist()
                for j, t in zip(todo, drawn, strict=True):
                    tokens[sampled[j]] = t
        for s, t in zip(states, tokens, strict=True):
            s.observe(t)
        lps: list[TokenLogprobs | None] = [None] * B
        if want_lp:
            chosen = torch.tensor([tokens[i] for i in want_lp], device=logits.device)
            for i, lp in zip(want_lp, self._logprobs(raw, chosen, [states[i] for i in want_lp]),
                             strict=True):
                lps[i] = lp
        return tokens, accepted, lps

    def _logprobs(self, raw: torch.Tensor, tokens: torch.Tensor,
                  states: list[SamplingState]) -> list[tuple[float, list[tuple[int, float]]]]:
        lp = torch.log_softmax(raw, dim=-1)  # [b, V]
        chosen = lp.gather(1, tokens[:, None])[:, 0].tolist()
        k = max(s.params.top_logprobs for s in states)
        top_v, top_i = (lp.topk(k, dim=-1) if k else (lp[:, :0], lp[:, :0].long()))
        top_v, top_i = top_v.tolist(), top_i.tolist()
        out = []
        for r, s in enumerate(states):
            n = s.params.top_logprobs
            out.append((chosen[r], list(zip(top_i[r][:n], top_v[r][:n], strict=True))))
        return out


PROMPT_LOGITS_ROWS = 512  # prompt positions turned into logits at once ([rows, V] fp32)


@torch.inference_mode()
def token_logprobs(logits: torch.Tensor, next_ids: torch.Tensor, k: int
                   ) -> list[PromptLogprobs]:
    """Per row of fp32 logits [N, V]: the logprob of next_ids[row] under the model's raw
    distribution, the k most likely (token, logprob) pairs and the token's rank: how many
    tokens are at least as likely (1: the most likely; vLLM's rank) (prompt logprobs)."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    chosen_t = lp.gather(1, next_ids[:, None].to(lp.device))  # [N, 1]
    ranks = (lp >= chosen_t).sum(dim=-1).tolist()
    chosen = chosen_t[:, 0].tolist()
    if not k:
        return [(c, [], r) for c, r in zip(chosen, ranks, strict=True)]
    top_v, top_i = lp.topk(k, dim=-1)
    return [(c, list(zip(i, v, strict=True)), r)
            for c, i, v, r in zip(chosen, top_i.tolist(), top_v.tolist(), ranks, strict=True)]

