"""Each quant method served through `core serve` (issue 14's "each method serves"), on a GPU.

    python bench/serve_methods.py --out serve_methods.json [--methods bf16,fp8,...]

For every case a `core serve` subprocess (bench/serving_online.ServerProcess) serves a dummy
model of Llama-3.1-8B's shapes (or --config's): bf16; online `--quantization fp8` and `w8a8_int8`; and
checkpoints whose config.json carries a `quantization_config` as real ones write it (block FP8
as Qwen3-FP8 / DeepSeek, AWQ and GPTQ INT4 group 128; bench_serving.QUANT_CONFIGS), which the
resolver reads without a flag. Per case: start-up time, the quant method the plan names
(/get_server_info), and a greedy /v1/completions request of 16 tokens (dummy weights: the
tokens are not meaningful, their count and the plan are what is checked). A case fails when the
server does not come up, names another method, or returns fewer tokens.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

from bench_serving import LLAMA_31_8B, QUANT_CONFIGS, make_model_dir  # noqa: E402
from serving_online import ServerProcess  # noqa: E402

from conformance.server_kit import http_request  # noqa: E402

# case -> (quantization_config key or None, --quantization or None, the method the plan names)
CASES = {"bf16": (None, None, "unquantized"), "fp8": (None, "fp8", "fp8"),
         "w8a8_int8": (None, "w8a8_int8", "w8a8_int8"), "fp8-block": ("fp8-block", None, "fp8"),
         "awq": ("awq", None, "awq"), "gptq": ("gptq", None, "gptq")}


def _call(srv: ServerProcess, method: str, path: str, body: dict | None = None,
          timeout: float = 60.0) -> dict:
    """One JSON request to the server (conformance.server_kit.http_request); a non-200 raises
    with the server's answer."""
    status, _, data = http_request(srv.url, method, path, body,
                                   {"Authorization": f"Bearer {srv.api_key}"}, timeout=timeout)
    if status != 200:
        raise RuntimeError(f"{method} {path}: HTTP {status}: {data[:500]!r}")
    return json.loads(data)


def serve_case(name: str, work: Path, device: str, extra: list[str], timeout: float,
               base: dict | None = None) -> dict:
    qcfg, quantization, expect = CASES[name]
    cfg = dict(base or LLAMA_31_8B)
    if qcfg:
        cfg["quantization_config"] = QUANT_CONFIGS[qcfg]
    model_dir = make_model_dir(cfg, work / name)
    flags = ["--model-path", model_dir, "--load-format", "dummy", "--device", device,
             "--dtype", "bfloat16", *extra]
    if quantization:
        flags += ["--quantization", quantization]
    res: dict = {"case": name, "flags": flags, "expect_method": expect}
    try:
        with ServerProcess(flags, work / f"{name}.log", timeout) as srv:
            res["startup_s"] = srv.startup_s
            info = _call(srv, "GET", "/get_server_info")
            plan = info.get("plan") or {}
            res["plan_quant_method"] = plan.get("quant_method")
            res["plan"] = {k: plan.get(k) for k in ("quant_method", "quant_format", "dtype",
                                                   "decode_attention", "layer_ops",
                                                   "moe_runner")}
            t = time.perf_counter()
            out = _call(srv, "POST", "/v1/completions",
                        {"prompt": list(range(1000, 1064)), "max_tokens": 16,
                         "temperature": 0, "ignore_eos": True}, timeout=300.0)
            res["request_s"] = time.perf_counter() - t
            res["completion_tokens"] = out["usage"]["completion_tokens"]
    except Exception as exc:  # noqa: BLE001 - the other cases still run
        res["error"] = f"{type(exc).__name__}: {exc}"[:2000]
    res["ok"] = ("error" not in res and res.get("plan_quant_method") == expect
                 and res.get("completion_tokens") == 16)
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--methods", default=",".join(CASES), help=f"comma list of {list(CASES)}")
    p.add_argument("--device", default="cuda")
    p.add_argument("--config", default=None,
                   help="an HF config.json to serve instead of Llama-3.1-8B's shapes (e.g. "
                        "tests/fixtures/configs/qwen3-30b-a3b.json: the plan then names its "
                        "MoE runner too)")
    p.add_argument("--server-extra-args", default="--cuda-graph-max-bs 4",
                   help="more `core serve` flags for every case")
    p.add_argument("--startup-timeout", type=float, default=600.0)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    names = [m.strip() for m in a.methods.split(",") if m.strip()]
    unknown = [m for m in names if m not in CASES]
    if unknown:
        p.error(f"unknown cases {unknown}; known: {list(CASES)}")
    base = json.loads(Path(a.config).read_text()) if a.config else None
    results = []
    with tempfile.TemporaryDirectory(prefix="serve_methods_") as tmp:
        for name in names:
            r = serve_case(name, Path(tmp), a.device, a.server_extra_args.split(),
                           a.startup_timeout, base)
            if not r["ok"] and "error" in r:
                log = Path(tmp) / f"{name}.log"
                r["log_tail"] = log.read_text(errors="replace")[-3000:] if log.exists() else ""
            print(json.dumps({k: v for k, v in r.items() if k not in ("flags", "log_tail")}),
                  flush=True)
            results.append(r)
    if a.out:
        Path(a.out).write_text(json.dumps(results, indent=1))
    failed = [r["case"] for r in results if not r["ok"]]
    print(f"{len(results) - len(failed)} of {len(results)} cases served"
          + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
