"""The report side of bench_serving.py: headline numbers, the summary table, strict JSON."""

from __future__ import annotations

import math
from typing import Any


def jsonable(obj: Any) -> Any:
    """inf / nan as strings: strict JSON has no such numbers (--request-rate inf)."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, dict):
        return {k: jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    return obj


def ratio(x: float | None, y: float | None) -> float | None:
    return round(x / y, 3) if x and y else None


def summarize(report: dict[str, Any]) -> dict[str, Any]:
    """The headline numbers and ratios of a report (stages that failed are left out)."""
    s: dict[str, Any] = {}
    eg, hf = report.get("engine_graphs") or {}, report.get("hf") or {}
    if "batch1" in eg:
        b1 = eg["batch1"]["decode_tok_s"]
        s["batch1_decode_tok_s_graphs"] = b1
        s["batch1_vs_roofline"] = ratio(b1, report.get("roofline_decode_tok_s"))
        ee = (report.get("engine_eager") or {}).get("batch1", {}).get("decode_tok_s")
        if ee:
            s["batch1_decode_tok_s_eager"] = ee
            s["batch1_graphs_vs_eager"] = ratio(b1, ee)
        if "batch1" in hf:
            s["hf_batch1_decode_tok_s"] = hf["batch1"]["decode_tok_s"]
            s["batch1_vs_hf"] = ratio(b1, hf["batch1"]["decode_tok_s"])
    if "offline" in eg:
        s["offline_output_tok_s"] = eg["offline"]["output_tok_s"]
        if "offline_floor" in report:  # floor seconds / measured seconds (bench/floors.py)
            s["offline_vs_floor"] = round(report["offline_floor"]["fraction"], 3)
        if "offline" in hf:
            s["hf_offline_output_tok_s"] = hf["offline"]["output_tok_s"]
            s["offline_vs_hf"] = ratio(eg["offline"]["output_tok_s"],
                                       hf["offline"]["output_tok_s"])
            s["hf_offline_method"] = hf["offline"]["method"]
            s["hf_offline_label"] = hf["offline"]["method"].split(" (")[0]
    on = report.get("online") or {}
    if "completed" in on:
        s.update({f"online_{k}": on[k] for k in (
            "completed", "failed", "request_throughput", "output_tok_s", "ttft_median_ms",
            "ttft_p99_ms", "tpot_median_ms", "itl_median_ms", "itl_p99_ms")})
    off_tok_s = (eg.get("offline") or {}).get("output_tok_s")
    for name, v in (report.get("offline_variants") or {}).items():
        if "offline" in v:
            s[f"offline[{name}]_output_tok_s"] = v["offline"]["output_tok_s"]
            s[f"offline[{name}]_vs_offline"] = ratio(v["offline"]["output_tok_s"], off_tok_s)
    for name, v in (report.get("online_variants") or {}).items():
        if "completed" not in v:
            continue
        s[f"online[{name}]"] = {
            **{k: v[k] for k in ("completed", "failed", "output_tok_s", "ttft_p99_ms",
                                 "itl_median_ms", "itl_p99_ms")},
            "vs_offline": ratio(v["output_tok_s"], off_tok_s) if off_tok_s else None,
            "prefill_capped_steps": (v.get("engine_stats") or {}).get("prefill_capped_steps")}
    sp = report.get("shared_prefix") or {}
    if sp:
        s["shared_prefix_radix_vs_no_radix"] = sp.get("ratio")
        s["shared_prefix_cached_tokens"] = (sp.get("radix_on") or {}).get("cached_tokens_total")
    return s


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def _num(x: float | None, nd: int = 1) -> str:
    return "-" if x is None else f"{x:,.{nd}f}"


def _error_line(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.strip()] or [""]
    text = lines[0] if len(lines) == 1 else f"{lines[0]} ... {lines[-1]}"
    return text[:200]


def _three(d: dict[str, Any], k: str) -> str:
    return " / ".join(_ms(d.get(f"{k}_{q}_ms")) for q in ("mean", "median", "p99"))


def summary_table(report: dict[str, Any]) -> str:
    """A short human-readable table of the headline numbers (one row per measure)."""
    rows: list[tuple[str, str, str]] = []
    eg, hf, s = report.get("engine_graphs") or {}, report.get("hf") or {}, report["summary"]
    for name, part in (("engine", eg), ("hf", hf), ("online", report.get("online") or {}),
                       ("eager", report.get("engine_eager") or {})):
        if "error" in part:
            rows.append((name, "FAILED", _error_line(part["error"])))
    if "batch1" in eg:
        b = eg["batch1"]
        note = f"{_num(s.get('batch1_vs_roofline'), 2)} of roofline " \
               f"{_num(report.get('roofline_decode_tok_s'))}"
        if "batch1_vs_hf" in s:
            note += f"; {_num(s['batch1_vs_hf'], 2)}x HF ({_num(s['hf_batch1_decode_tok_s'])})"
        rows.append(("batch1", "decode tok/s", f"{_num(b['decode_tok_s'])}  ({note})"))
        if "batch1_decode_tok_s_eager" in s:
            rows.append(("batch1", "decode tok/s eager",
                         f"{_num(s['batch1_decode_tok_s_eager'])}  (graphs "
                         f"{_num(s['batch1_graphs_vs_eager'], 2)}x eager)"))
        rows.append(("batch1", "TTFT ms", _ms(b["ttft_ms"])))
    if "offline" in eg:
        o = eg["offline"]
        note = ""
        if "offline_vs_hf" in s:
            note = f"  ({_num(s['offline_vs_hf'], 1)}x HF {s['hf_offline_label']}: " \
                   f"{_num(s['hf_offline_output_tok_s'])} on {hf['offline']['requests']} req)"
        rows.append(("offline", f"{o['requests']} req {o['input_len']}/{o['output_len']} "
                     f"out tok/s", f"{_num(o['output_tok_s'])}{note}"))
        rows.append(("offline", "req/s | in tok/s | wall s",
                     f"{_num(o['request_throughput'], 2)} | {_num(o['input_tok_s'])} | "
                     f"{_num(o['wall_s'])}"))
        rows.append(("offline", "TTFT ms mean/p50/p99", _three(o, "ttft")))
        rows.append(("offline", "TPOT ms mean/p50/p99", _three(o, "tpot")))
    on = report.get("online") or {}
    if "completed" in on:
        rows.append(("online", f"{on['num_prompts']} req {on['input_len']}/{on['output_len']} "
                     f"@ {on['request_rate']}/s, conc {on['max_concurrency']}",
                     f"completed {on['completed']}, failed {on['failed']}, "
                     f"{_num(on['duration_s'])} s"))
        rows.append(("online", "req/s | in tok/s | out tok/s",
                     f"{_num(on['request_throughput'], 2)} | {_num(on['input_tok_s'])} | "
                     f"{_num(on['output_tok_s'])}"))
        for k in ("ttft", "tpot", "itl", "e2e"):
            rows.append(("online", f"{k.upper()} ms mean/p50/p99", _three(on, k)))
    for name, v in (report.get("offline_variants") or {}).items():
        if "error" in v:
            rows.append((f"offline[{name}]", "FAILED", _error_line(v["error"])))
        elif "offline" in v:
            o = v["offline"]
            vs = s.get(f"offline[{name}]_vs_offline")
            rows.append((f"offline[{name}]", f"{o['requests']} req out tok/s | capped steps",
                         f"{_num(o['output_tok_s'])}" + (f"  ({_num(vs, 3)} of offline)" if vs
                                                         else "")
                         + f" | {v.get('prefill_capped_steps', '-')}"))
    for name, v in (report.get("online_variants") or {}).items():
        if "error" in v:
            rows.append((f"online[{name}]", "FAILED", _error_line(v["error"])))
            continue
        vs = (s.get(f"online[{name}]") or {}).get("vs_offline")
        es = v.get("engine_stats") or {}
        rows.append((f"online[{name}]", f"{v['num_prompts']} req {v['input_len']}/"
                     f"{v['output_len']} @ {v['request_rate']}/s, conc {v['max_concurrency']}"
                     " out tok/s",
                     f"{_num(v['output_tok_s'])}" + (f"  ({_num(vs, 3)} of offline)" if vs
                                                      else "")))
        for k in ("ttft", "itl"):
            rows.append((f"online[{name}]", f"{k.upper()} ms mean/p50/p99", _three(v, k)))
        rows.append((f"online[{name}]", "budget target ms | last cap | capped steps",
                     f"{es.get('prefill_budget_target_ms', '-')} | "
                     f"{es.get('prefill_budget_tokens', '-')} | "
                     f"{es.get('prefill_capped_steps', '-')}"))
    sp = report.get("shared_prefix") or {}
    if sp:
        w = sp["workload"]
        shape = f"{w['num_requests']} req, {w['prefix_len']}+{w['suffix_len']} in, " \
                f"{w['output_len']} out"
        for key in ("radix_on", "radix_off"):
            r = sp.get(key) or {}
            if "error" in r:
                rows.append(("shared-prefix", f"{key} FAILED", _error_line(r["error"])))
            elif r:
                rows.append(("shared-prefix", f"{key} req/s",
                             f"{_num(r['request_throughput'], 2)}  ({shape}; cached "
                             f"{r['cached_tokens_total']} tokens, wall {_num(r['wall_s'], 2)} s)"))
        rows.append(("shared-prefix", "radix on / off",
                     f"{_num(sp.get('ratio'), 2)}x  (issue target >= 3x on the H200)"))
    w0 = max((len(r[0]) for r in rows), default=0)
    w1 = max((len(r[1]) for r in rows), default=0)
    stages = ", ".join(f"{k} {v:g}" for k, v in (report.get("stage_wall_s") or {}).items())
    head = f"summary ({report['device']}, {report['args']['scenario']} scenario; " \
           f"wall s: {stages})"
    return "\n".join([head, *(f"{m:<{w0}}  {k:<{w1}}  {v}" for m, k, v in rows)])
