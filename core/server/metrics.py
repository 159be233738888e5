"""Prometheus text exposition (format 0.0.4) for the server, without a client library.

Counters and histograms are kept here, in the HTTP process; gauges for the engine's live figures
(running / queued requests, KV pages, prefix-cache hit rate) are read from `EngineLike.stats()`
at scrape time.

Data parallel (--dp-size N, stats with `replicas`): each engine gauge has one sample per replica,
labelled dp_rank="0".."N-1" (as vLLM's `engine` and SGLang's `dp_rank` labels), and no unlabelled
total, which `sum()` would count twice: `sum without (dp_rank) (...)` is the engine's. Beside them,
`engine_replica_up` and `dp_routed_requests_total` (requests the router sent there) per replica;
`engine_up` stays one sample, 1 while every replica answers.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from typing import Any

PREFIX = "core_"
# speculative decoding's counters (the scheduler's spec_* stats): core_spec_decode_<name>_total
SPEC_COUNTERS = (("num_drafts", "requests' draft lists verified (one per request and verify step)"),
                 ("num_draft_tokens", "draft tokens verified"),
                 ("num_accepted_tokens", "draft tokens the target accepted"))

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15,
               0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0)

COMPILE_OUTCOMES = ("ok", "refused", "timeout", "crashed", "cancelled", "failed")
OUTCOMES = ("success", "client_error", "rejected", "aborted", "server_error")


def _escape(v: str) -> str:
    return v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(d: dict[str, str]) -> str:
    if not d:
        return ""
    return "{" + ",".join(f'{k}="{_escape(str(v))}"' for k, v in sorted(d.items())) + "}"


def _num(v: float) -> str:
    if isinstance(v, float) and math.isnan(v):
        return "NaN"
    if v == math.inf:
        return "+Inf"
    return repr(float(v)) if isinstance(v, float) else str(v)


class Histogram:
    """Cumulative-bucket histogram (one label-less series)."""

    def __init__(self, name: str, help: str, buckets: tuple[float, ...]):
        self.name, self.help, self.buckets = name, help, buckets
        self.counts = [0] * (len(buckets) + 1)  # last: +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, v: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, v)] += 1
        self.sum += v
        self.count += 1

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        cum = 0
        for le, c in zip((*self.buckets, math.inf), self.counts, strict=True):
            cum += c
            lines.append(f'{self.name}_bucket{{le="{_num(float(le))}"}} {cum}')
        lines += [f"{self.name}_sum {_num(self.sum)}", f"{self.name}_count {self.count}"]
        return lines


class ServerMetrics:
    """Everything /metrics shows that the HTTP process measures itself."""

    def __init__(self) -> None:
        self.requests: dict[tuple[str, str], int] = {}  # (endpoint, outcome) -> count
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.cached_tokens = 0
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds",
                              "time from request arrival to its first output token", TTFT_BUCKETS)
        self.itl = Histogram(PREFIX + "inter_token_latency_seconds",
                             "time between consecutive output tokens of a request", ITL_BUCKETS)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds",
                             "time from request arrival to its last output token", E2E_BUCKETS)

    def count_request(self, endpoint: str, outcome: str) -> None:
        key = (endpoint, outcome)
        self.requests[key] = self.requests.get(key, 0) + 1

    def render(self, stats: dict[str, Any], engine_alive: bool) -> str:
        out: list[str] = []

        def metric(name: str, kind: str, help: str,
                   samples: Sequence[tuple[dict[str, str], float]]) -> None:
            full = PREFIX + name
            out.extend([f"# HELP {full} {help}", f"# TYPE {full} {kind}"])
            out.extend(f"{full}{_labels(lab)} {_num(v)}" for lab, v in samples)

        samples: list[tuple[dict[str, str], float]] = [
            ({"endpoint": ep, "outcome": oc}, n) for (ep, oc), n in sorted(self.requests.items())]
        metric("requests_total", "counter", "finished HTTP API requests by endpoint and outcome",
               samples)
        metric("prompt_tokens_total", "counter", "prompt tokens processed",
               [({}, self.prompt_tokens)])
        metric("generation_tokens_total", "counter", "output tokens generated",
               [({}, self.generation_tokens)])
        metric("cached_prompt_tokens_total", "counter", "prompt tokens served from the prefix "
               "cache", [({}, self.cached_tokens)])
        for h in (self.ttft, self.itl, self.e2e):
            out.extend(h.render())
        metric("engine_up", "gauge", "1 when the engine process answers", [({}, int(engine_alive))])
        gauges: tuple[tuple[str, str], ...] = (
            ("num_running_reqs", "requests being decoded"),
            ("num_queued_reqs", "requests waiting for admission"),
            ("kv_pages_used", "KV-cache pages held by requests and the prefix cache"),
            ("kv_pages_total", "KV-cache pages in the pool"),
            ("prefix_cache_hit_rate", "fraction of prompt tokens found in the prefix cache"))
        replicas = stats.get("replicas")
        if isinstance(replicas, list):  # data parallel: per replica, labelled dp_rank
            ranks = [({"dp_rank": str(r.get("dp_rank", i))}, r) for i, r in enumerate(replicas)]
            metric("engine_replica_up", "gauge", "1 while the data-parallel replica's worker is "
                   "alive", [(lab, int(bool(r.get("alive")))) for lab, r in ranks])
            metric("dp_routed_requests_total", "counter", "requests the router sent to the "
                   "data-parallel replica", [(lab, r.get("routed", 0)) for lab, r in ranks])
        else:
            ranks = [({}, stats)]
        gauges += (("grammar_compiles_running", "grammar compiles running in compile processes"),
                   ("grammar_compiles_queued", "grammar compiles waiting for a compile process"),
                   ("prefill_budget_tokens", "prompt tokens the latest step beside running "
                    "decodes could extend (the prefill budget, --decode-itl-target-ms)"))
        for key, help in gauges:
            samples = [(lab, v) for lab, r in ranks
                       if isinstance(v := r.get(key), (int, float)) and not isinstance(v, bool)]
            if samples:
                metric(key, "gauge", help, samples)
        samples = [({**lab, "outcome": o}, r[f"grammar_compiles_{o}"]) for lab, r in ranks
                   for o in COMPILE_OUTCOMES if f"grammar_compiles_{o}" in r]
        if samples:
            metric("grammar_compiles_total", "counter", "grammar compiles by outcome (ok, "
                   "refused by the library, timeout, crashed, cancelled with their requests, "
                   "failed in the backend)", samples)
        samples = [(lab, r["prefill_capped_steps"]) for lab, r in ranks
                   if "prefill_capped_steps" in r]
        if samples:
            metric("prefill_capped_steps_total", "counter", "extends beside running decodes "
                   "that the prefill budget cut short (prompt tokens left for later steps)",
                   samples)
        for key, help in SPEC_COUNTERS:  # speculative decoding, when it is on
            samples = [(lab, r[f"spec_{key}"]) for lab, r in ranks if f"spec_{key}" in r]
            if samples:
                metric(f"spec_decode_{key}_total", "counter", help, samples)
        return "\n".join(out) + "\n"
