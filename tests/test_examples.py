"""The example third-party plugins, installed the way a user installs them, seen by core-serve.

Each example distribution is pip-installed once into a temporary directory (never into the test
environment) and core-serve runs in subprocesses with that directory on PYTHONPATH, where
importlib.metadata finds its dist-info and so its `core.plugins` entry point. Without the
PYTHONPATH the package is, as far as core-serve can tell, uninstalled.

The conformance tests run pytest itself in a package's folder, as its author would: on the example
(`example_sdpa` passes) and on tests/fixtures/core-wrong-backend (a deliberately wrong backend
fails).
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.version import Version

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"
FIXTURES = REPO / "tests" / "fixtures"
CONFIGS = FIXTURES / "configs"

# Env vars that change what loads; the tests set them explicitly when they mean to.
CONTROL_VARS = ("CORE_STRICT_PLUGINS", "CORE_PLUGINS_ALLOW", "CORE_PLUGINS_DENY",
                "CORE_EXAMPLE_ACCEL")


def _local_setuptools_builds_wheels() -> bool:
    """setuptools >= 70.1 builds wheels by itself (older ones also need the `wheel` package)."""
    try:
        return Version(importlib.metadata.version("setuptools")) >= Version("70.1")
    except importlib.metadata.PackageNotFoundError:
        return False


def _install(tmp_path_factory: pytest.TempPathFactory, name: str,
             parent: Path = EXAMPLES) -> Path:
    """pip-install <parent>/<name> into a fresh directory and return that directory (its
    sibling `src` is the copy it was built from)."""
    root = tmp_path_factory.mktemp(name)
    # Build from a copy so that setuptools' build/ and egg-info never land in the source tree.
    src = root / "src"
    shutil.copytree(parent / name, src,
                    ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__",
                                                  ".pytest_cache"))
    site = root / "site"
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
           "--no-deps", "--target", str(site), str(src)]
    if _local_setuptools_builds_wheels():
        # Build with the setuptools already installed and never touch the network.
        cmd += ["--no-index", "--no-build-isolation"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, f"pip install of {name} failed:\n{proc.stdout}\n{proc.stderr}"
    return site


@pytest.fixture(scope="module")
def example_site(tmp_path_factory) -> Path:
    return _install(tmp_path_factory, "core-example-backend")


@pytest.fixture(scope="module")
def broken_site(tmp_path_factory) -> Path:
    return _install(tmp_path_factory, "core-broken-plugin")


@pytest.fixture(scope="module")
def wrong_site(tmp_path_factory) -> Path:
    return _install(tmp_path_factory, "core-wrong-backend", parent=FIXTURES)


def _env(*sites: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in CONTROL_VARS}
    paths = [str(s) for s in sites]
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    if paths:
        env["PYTHONPATH"] = os.pathsep.join(paths)
    env.update(extra)
    return env


def _python(code: str, *sites: Path, **extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=REPO, env=_env(*sites, **extra), timeout=120)


# Dumps what build_registry() found, as JSON on stdout.
REGISTRY_DUMP = """
import json, sys
from core.plan.registry import build_registry
r = build_registry()
out = {
    "entries": {kind: {name: {"dist": e.origin.dist, "version": e.origin.version,
                              "plugin": e.origin.plugin}
                       for name, e in r.kind(kind).items()}
                for kind in ("attention", "hardware")},
    "failures": [{"dist": f.origin.dist, "plugin": f.origin.plugin, "stage": f.stage,
                  "error": f.error} for f in r.failures],
}
if "example_sdpa" in r.kind("attention"):
    caps = r.get("attention", "example_sdpa").caps
    out["example_sdpa_caps"] = {"page_sizes": [caps.page_sizes.mode, list(caps.page_sizes.values)],
                                "head_sizes": sorted(caps.head_sizes),
                                "sliding_window": caps.sliding_window,
                                "logit_softcap": caps.logit_softcap}
if "example_accel" in r.kind("hardware"):
    info = r.probe("example_accel")
    out["example_accel"] = {"available": info.available, "reason": info.reason,
                            "device_type": info.device_type, "name": info.name}
# Declaring and probing must not import the backend implementation.
out["backend_imported"] = "core_example_backend.backend" in sys.modules
print(json.dumps(out))
"""


def _registry(*sites: Path, **extra: str) -> dict:
    proc = _python(REGISTRY_DUMP, *sites, **extra)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


# --- discovery through build_registry -------------------------------------------------------

def test_declaring_and_probing_import_nothing_heavy(example_site):
    reg = _registry(example_site)
    assert reg["entries"]["attention"]["example_sdpa"]["plugin"] == "example"
    assert reg["example_sdpa_caps"] == {"page_sizes": ["set", [16]], "head_sizes": [64, 128],
                                        "sliding_window": False, "logit_softcap": False}
    assert reg["example_accel"]["available"] is False
    # The "module:attr" factory is resolved only when the backend is chosen.
    assert reg["backend_imported"] is False


def test_deny_list_keeps_installed_example_out(example_site):
    reg = _registry(example_site, CORE_PLUGINS_DENY="core-example-backend")
    assert "example_sdpa" not in reg["entries"]["attention"]
    assert "example_accel" not in reg["entries"]["hardware"]
    assert "torch_native" in reg["entries"]["attention"]


# --- the `core` CLI ---------------------------------------------------------------------------

def _core(args: list[str], *sites: Path, **extra: str) -> subprocess.CompletedProcess:
    """Run the `core` console script (or `python -m core.cli` where it is not installed)."""
    script = Path(sys.executable).with_name("core")
    cmd = [str(script)] if script.is_file() else [sys.executable, "-m", "core.cli"]
    return subprocess.run(cmd + args, capture_output=True, text=True, cwd=REPO,
                          env=_env(*sites, **extra), timeout=120)


def _backends(*sites: Path, **extra: str) -> dict:
    proc = _core(["backends", "--json"], *sites, **extra)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    data["rows"] = {(r["kind"], r["name"]): r for r in data["plugins"]}
    return data


def _resolve(model: str, *sites: Path, extra_args: tuple[str, ...] = (),
             **env: str) -> subprocess.CompletedProcess:
    return _core(["resolve", "--model-path", str(CONFIGS / f"{model}.json"),
                  "--device-profile", "xeon-amx", *extra_args], *sites, **env)


def test_backends_lists_the_installed_example(example_site):
    data = _backends(example_site)
    sdpa = data["rows"][("attention", "example_sdpa")]
    assert (sdpa["distribution"], sdpa["version"], sdpa["plugin"], sdpa["status"]) == \
        ("core-example-backend", "0.1.0", "example", "available")
    assert "heads=64|128" in sdpa["summary"] and "pages=16" in sdpa["summary"]
    accel = data["rows"][("hardware", "example_accel")]
    assert (accel["distribution"], accel["status"]) == ("core-example-backend", "unavailable")
    assert "CORE_EXAMPLE_ACCEL=1" in accel["reason"]
    # The built-in reference is still there beside it, and the example loaded cleanly.
    assert data["rows"][("attention", "torch_native")]["distribution"] == "core-serve"
    assert not [f for f in data["failures"] if f["distribution"] == "core-example-backend"]


def test_example_accel_is_available_when_enabled(example_site):
    accel = _backends(example_site, CORE_EXAMPLE_ACCEL="1")["rows"][("hardware", "example_accel")]
    assert accel["status"] == "available"
    # The probe's device description (name and all) is only there when it reports available.
    assert "Example Accelerator" in json.dumps(accel)


def test_forced_example_sdpa_is_chosen_and_adopts_page_size_16(example_site):
    proc = _resolve("llama-3.1-8b", example_site,
                    extra_args=("--attention-backend", "example_sdpa", "--json"))
    assert proc.returncode == 0, proc.stderr
    plan = json.loads(proc.stdout)["plan"]
    assert (plan["prefill_attention"], plan["decode_attention"]) == ("example_sdpa",
                                                                     "example_sdpa")
    assert plan["page_size"] == 16
    # The user left --page-size open: the plan says it adopted 16 and why.
    assert any(re.search(r"page size 16 adopted.*example_sdpa", n) for n in plan["notes"]), \
        plan["notes"]
    chosen = [c for c in plan["candidates"] if c["chosen"] and c["name"] == "example_sdpa"]
    assert {c["origin"] for c in chosen} == {"core-example-backend 0.1.0 (example)"}


def test_example_sdpa_fits_but_is_not_preferred_on_cpu(example_site):
    proc = _resolve("llama-3.1-8b", example_site)
    assert proc.returncode == 0, proc.stderr
    # Human-readable output: the C backend (its build for this CPU's ISA) wins on priority,
    # numba_cpu (a test dependency) and torch_native fit; example_sdpa is listed as fitting.
    assert re.search(r"prefill attention\s+cpu_c", proc.stdout), proc.stdout
    assert re.search(r"numba_cpu\s+fits", proc.stdout), proc.stdout
    assert re.search(r"torch_native\s+fits", proc.stdout), proc.stdout
    assert re.search(r"example_sdpa\s+fits", proc.stdout), proc.stdout


@pytest.mark.parametrize("model, reasons", [
    ("gemma-2-9b", ("head dim 256 not supported", "no sliding-window support",
                    "no logit soft-cap support")),
    ("mistral-7b-v0.1", ("no sliding-window support",)),
])
def test_forced_example_sdpa_is_refused_with_reasons(example_site, model, reasons):
    proc = _resolve(model, example_site,
                    extra_args=("--attention-backend", "example_sdpa", "--json"))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    err = json.loads(proc.stdout)
    assert "example_sdpa" in err["error"]
    for reason in reasons:
        assert any(reason in r for r in err["reasons"]), (reason, err["reasons"])
    assert "torch_native" in err["would_fit"]
    assert "plan" not in err  # nothing silently swapped in


def test_uninstalled_example_is_gone():
    data = _backends()
    assert not [r for r in data["plugins"] if r["distribution"] == "core-example-backend"]
    assert ("attention", "torch_native") in data["rows"]
    proc = _resolve("llama-3.1-8b", extra_args=("--attention-backend", "example_sdpa", "--json"))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "unknown attention backend 'example_sdpa'" in json.loads(proc.stdout)["error"]


def test_broken_plugin_is_listed_under_failures(broken_site, example_site):
    data = _backends(broken_site, example_site)
    broken = [f for f in data["failures"] if f["distribution"] == "core-broken-plugin"]
    assert len(broken) == 1
    assert (broken[0]["plugin"], broken[0]["version"], broken[0]["stage"]) == \
        ("broken", "0.0.1", "import")
    assert "deliberately broken" in broken[0]["error"]
    # Everything else still loads, the other third-party plugin included.
    assert ("attention", "torch_native") in data["rows"]
    assert ("attention", "example_sdpa") in data["rows"]


def test_broken_plugin_is_fatal_in_strict_mode(broken_site):
    proc = _core(["backends", "--json"], broken_site, CORE_STRICT_PLUGINS="1")
    assert proc.returncode != 0
    assert proc.stdout == ""
    assert "core-broken-plugin" in proc.stderr and "deliberately broken" in proc.stderr
    assert "CORE_STRICT_PLUGINS" in proc.stderr
    assert "Traceback" not in proc.stderr


# --- the support matrix (core matrix, core/plan/matrix.py) ------------------------------------

def test_matrix_lists_the_installed_example_with_its_distribution(example_site):
    proc = _core(["matrix", "--json"], example_site)
    assert proc.returncode == 0, proc.stderr
    kinds = json.loads(proc.stdout)["kinds"]
    sdpa = next(r for r in kinds["attention"] if r["name"] == "example_sdpa")
    assert (sdpa["distribution"], sdpa["version"], sdpa["plugin"]) == \
        ("core-example-backend", "0.1.0", "example")
    # the dataclass, not a summary string
    assert sdpa["caps"]["head_sizes"] == [64, 128]
    assert sdpa["caps"]["page_sizes"] == {"mode": "set", "values": [16]}
    assert sdpa["caps"]["priority"] == {"cpu": 5, "cuda": 0, "example_accel": 10}
    accel = next(r for r in kinds["hardware"] if r["name"] == "example_accel")
    assert accel["distribution"] == "core-example-backend"
    proc = _core(["matrix", "--kind", "attention"], example_site)
    assert proc.returncode == 0, proc.stderr
    row = next(ln for ln in proc.stdout.splitlines() if ln.startswith("| example_sdpa |"))
    assert "| core-example-backend 0.1.0 (example) | cpu, cuda, example_accel |" in row
    assert "| 64, 128 | 16 |" in row
    assert "| torch_native | core-serve " in proc.stdout


def test_matrix_lists_the_broken_plugin_with_its_error(broken_site):
    proc = _core(["matrix", "--kind", "hardware"], broken_site)
    assert proc.returncode == 0, proc.stderr
    failed = proc.stdout.split("## Plugins that failed to load")[1]
    assert "| broken | core-broken-plugin 0.0.1 | import |" in failed
    assert "deliberately broken" in failed


def test_support_doc_leaves_the_installed_example_out(example_site, broken_site):
    """`core matrix --plans --only core-serve` gives docs/SUPPORT.md whatever else is
    installed (and the example's example_sdpa is never chosen in its plans)."""
    proc = _core(["matrix", "--plans", "--only", "core-serve"], example_site, broken_site)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == (REPO / "docs" / "SUPPORT.md").read_text(), \
        "docs/SUPPORT.md is stale: core matrix --plans --only core-serve > docs/SUPPORT.md"


# --- numerics: example_sdpa against torch_native and a dense reference ------------------------

# Runs one mixed extend step (requests with and without a cached prefix) and one decode step on
# a paged KV cache whose pages are scattered, through example_sdpa and through torch_native, each
# on its own pool, and through a dense float64 reference. Prints the largest differences.
NUMERICS = """
import dataclasses, json, torch
from core.contract.attention import AttentionLayerParams, BackendContext
from core.contract.forward_batch import ForwardBatch, ForwardMode
from core.engine.memory.kv_cache import KVPool
from core.plan.registry import build_registry

torch.manual_seed(0)
H, KVH, D, PAGE, LAYERS, LAYER = 4, 2, 64, 16, 2, 1
prefix, extend = [0, 5, 21], [9, 3, 2]
rows = [2, 0, 3]  # req_to_token row of each request
max_ctx, num_pages = 48, 12
ctx = BackendContext(num_heads=H, num_kv_heads=KVH, head_dim=D, num_layers=LAYERS,
                     dtype=torch.float32, kv_dtype=torch.float32, device=torch.device("cpu"),
                     page_size=PAGE, max_context_len=max_ctx)
layer = AttentionLayerParams(layer_id=LAYER, num_heads=H, num_kv_heads=KVH, head_dim=D,
                             scaling=D ** -0.5)

# Scattered pages; page 0 holds the reserved slot 0 and is never used.
pages = (torch.randperm(num_pages - 1) + 1).tolist()
req_to_token = torch.zeros(4, max_ctx, dtype=torch.int32)
for i, row in enumerate(rows):
    own = pages[3 * i: 3 * i + 3]
    req_to_token[row] = torch.tensor([own[t // PAGE] * PAGE + t % PAGE for t in range(max_ctx)])

total = [p + e + 1 for p, e in zip(prefix, extend)]  # +1: the decode token
K = [torch.randn(n, KVH, D) for n in total]
V = [torch.randn(n, KVH, D) for n in total]
Q = [torch.randn(n, H, D) for n in total]

def slots(i, lo, hi):
    return req_to_token[rows[i], lo:hi].long()

def make_batch(mode, starts, lens, pool):
    seq = [s + n for s, n in zip(starts, lens)]
    loc = torch.cat([slots(i, s, s + n) for i, (s, n) in enumerate(zip(starts, lens))])
    pos = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, lens)])
    return ForwardBatch(
        mode=mode, input_ids=torch.zeros(len(pos), dtype=torch.long), positions=pos,
        seq_lens=torch.tensor(seq, dtype=torch.int32),
        prefix_lens=torch.tensor(starts, dtype=torch.int32),
        extend_lens=torch.tensor(lens, dtype=torch.int32), out_cache_loc=loc,
        req_pool_indices=torch.tensor(rows, dtype=torch.long), req_to_token=req_to_token,
        kv_pool=pool, seq_lens_cpu=seq, prefix_lens_cpu=list(starts), extend_lens_cpu=list(lens))

def new_tokens(T, starts, lens):
    return torch.cat([T[i][s:s + n] for i, (s, n) in enumerate(zip(starts, lens))])

def dense(starts, lens):  # float64, from the unpaged tensors
    outs = []
    for i, (s, n) in enumerate(zip(starts, lens)):
        q = Q[i][s:s + n].double().transpose(0, 1)  # [H, n, D]
        k = K[i][:s + n].double().repeat_interleave(H // KVH, dim=1).transpose(0, 1)
        v = V[i][:s + n].double().repeat_interleave(H // KVH, dim=1).transpose(0, 1)
        scores = q @ k.transpose(1, 2) * D ** -0.5  # [H, n, s+n]
        visible = torch.arange(s + n)[None, :] <= torch.arange(s, s + n)[:, None]
        scores = scores.masked_fill(~visible, float("-inf"))
        outs.append((scores.softmax(-1) @ v).transpose(0, 1).reshape(n, H * D))
    return torch.cat(outs)

registry = build_registry()
steps = [(ForwardMode.EXTEND, prefix, extend),
         (ForwardMode.DECODE, [p + e for p, e in zip(prefix, extend)], [1, 1, 1])]
results = {}
for name in ("example_sdpa", "torch_native"):
    try:
        backend = registry.get("attention", name).load()(ctx)
    except Exception as exc:
        results[name] = {"error": f"{type(exc).__name__}: {exc}"}
        continue
    pool = KVPool(num_pages * PAGE, LAYERS, KVH, D, torch.float32, "cpu", page_size=PAGE)
    for i, p in enumerate(prefix):  # the cached prefix is already in the pool
        pool.set_kv(LAYER, slots(i, 0, p), K[i][:p], V[i][:p])
    outs = []
    for mode, starts, lens in steps:
        batch = make_batch(mode, starts, lens, pool)
        batch = dataclasses.replace(batch, attn_backend=backend, attn_meta=backend.prepare(batch))
        out = backend.forward(new_tokens(Q, starts, lens).reshape(-1, H * D),
                              new_tokens(K, starts, lens).reshape(-1, KVH * D),
                              new_tokens(V, starts, lens).reshape(-1, KVH * D), layer, batch)
        outs.append(out)
    results[name] = {"outs": outs, "k": pool.k_buffers[LAYER], "v": pool.v_buffers[LAYER]}

ex = results["example_sdpa"]
report = {"torch_native_error": results["torch_native"].get("error"),
          "shapes": [list(o.shape) for o in ex["outs"]],
          "vs_dense": [float((o.double() - dense(s, n)).abs().max())
                       for o, (_, s, n) in zip(ex["outs"], steps)],
          "kv_written": all(torch.equal(ex["k"][slots(i, 0, t)], K[i]) and
                            torch.equal(ex["v"][slots(i, 0, t)], V[i])
                            for i, t in enumerate(total))}
tn = results["torch_native"]
if "outs" in tn:
    report["vs_torch_native"] = [float((a - b).abs().max()) for a, b in zip(ex["outs"], tn["outs"])]
    report["same_kv_as_torch_native"] = torch.equal(ex["k"], tn["k"]) and torch.equal(ex["v"], tn["v"])
print(json.dumps(report))
"""


@pytest.fixture(scope="module")
def numerics(example_site) -> dict:
    proc = _python(NUMERICS, example_site)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_example_sdpa_matches_dense_reference(numerics):
    # 9+3+2 new tokens in the extend step, 3 in decode, H*D = 256 wide.
    assert numerics["shapes"] == [[14, 256], [3, 256]]
    assert max(numerics["vs_dense"]) < 1e-5, numerics["vs_dense"]
    assert numerics["kv_written"] is True


def test_example_sdpa_matches_torch_native(numerics):
    assert numerics["torch_native_error"] is None, numerics["torch_native_error"]
    assert max(numerics["vs_torch_native"]) < 1e-5, numerics["vs_torch_native"]
    assert numerics["same_kv_as_torch_native"] is True


# --- the conformance suite, run by a backend package ------------------------------------------

def _pytest_in(site: Path, *args: str) -> tuple[subprocess.CompletedProcess, dict[str, int]]:
    """`python -m pytest ARGS` in the package's folder (the copy it was installed from), as its
    author runs it; returns the process and the summary's counts ({"passed": 12, ...})."""
    env = _env(site, REPO)  # REPO: core importable outside the checkout, however it is installed
    for name in ("PYTEST_ADDOPTS", "PYTEST_PLUGINS", "PYTEST_DISABLE_PLUGIN_AUTOLOAD"):
        env.pop(name, None)  # the package's own pytest configuration, nothing from ours
    proc = subprocess.run([sys.executable, "-m", "pytest", "-v", "-rs", "-p", "no:cacheprovider",
                           *args], capture_output=True, text=True, cwd=site.parent / "src",
                          env=env, timeout=300)
    summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    counts = {word: int(n) for n, word in re.findall(r"(\d+) (passed|failed|skipped|errors?)",
                                                     summary)}
    return proc, counts


def _conformance_results(proc: subprocess.CompletedProcess, backend: str) -> dict[str, str]:
    """Conformance case id -> PASSED/FAILED/SKIPPED, from the verbose output."""
    pattern = rf"test_attention_backend_conformance\[({backend}-[^\]]+)\] (PASSED|FAILED|SKIPPED)"
    return dict(re.findall(pattern, proc.stdout))


def test_example_package_runs_the_conformance_suite(example_site):
    """The example's author runs `pytest --conformance-backend example_sdpa` in its folder: the
    suite runs every case example_sdpa declares (page size 16 only) and lists the rest as
    skipped with the reason; its own tests in tests/ run beside it."""
    proc, counts = _pytest_in(example_site, "--conformance-backend", "example_sdpa")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert counts.get("passed", 0) > 0 and counts.get("failed", 0) == 0, out
    assert "errors" not in counts and "error" not in counts, out
    results = _conformance_results(proc, "example_sdpa")
    ran = [case for case, status in results.items() if status == "PASSED"]
    assert ran and all("-p16-" in case for case in ran), results
    assert {mode for case in ran for mode in ("decode", "extend") if f"-{mode}-" in case} == \
        {"decode", "extend"}, ran
    assert {dtype for case in ran for dtype in ("float32", "float16", "bfloat16")
            if dtype in case} == {"float32", "float16", "bfloat16"}, ran
    assert "tests/test_backend.py::test_undeclared_head_size_is_refused PASSED" in out
    # What it does not declare is skipped, with the reason; nothing else is.
    assert {case for case, status in results.items() if status == "SKIPPED"} == {
        f"example_sdpa-cpu-not-covered-{key}"
        for key in ("page1", "page64", "window", "softcap", "sinks", "kv-fp8_e4m3",
                    "kv-fp8_e5m2", "verify_rows")}
    assert "page size 1 not declared (declares 16)" in out
    assert "sliding window not declared" in out


def test_example_package_runs_the_suite_by_plain_pytest(example_site):
    """Its pyproject names the backend, so a plain `pytest` there runs the same suite."""
    proc, counts = _pytest_in(example_site)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = _conformance_results(proc, "example_sdpa")
    assert counts.get("failed", 0) == 0 and \
        sum(status == "PASSED" for status in results.values()) > 0, proc.stdout


def test_conformance_suite_fails_a_wrong_backend(wrong_site):
    """A package whose backend has an off-by-one causal mask fails the suite: every extend case
    fails on its output, decode cases (which the bug cannot reach) pass."""
    proc, counts = _pytest_in(wrong_site, "--conformance-backend", "wrong_mask")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert counts.get("failed", 0) > 0 and counts.get("passed", 0) > 0, out
    results = _conformance_results(proc, "wrong_mask")
    failed = {case for case, status in results.items() if status == "FAILED"}
    passed = {case for case, status in results.items() if status == "PASSED"}
    assert failed and all("-extend-" in case for case in failed), results
    assert passed and all("-decode-" in case for case in passed), results
    assert len(failed) == counts["failed"]
    assert re.search(r"wrong_mask layer \d extend output differs from the fp32 reference", out)


# --- the example accelerator serves end to end through its own Platform --------------------------

def test_core_serve_runs_on_the_example_accelerator(example_site):
    """`core serve --device example_accel`: a third-party hardware target with a Platform of its
    own (memory defaults, copies, no graphs) serves a chat completion; core-serve is unchanged.
    The example's SDPA backend is the one attention backend declaring that target."""
    import signal

    from conformance.server_kit import free_port, http_request, read_until_listening

    port = free_port()
    script = Path(sys.executable).with_name("core")
    cmd = [str(script)] if script.is_file() else [sys.executable, "-m", "core.cli"]
    proc = subprocess.Popen(cmd + ["serve", "--device", "example_accel", "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO,
                            env=_env(example_site, CORE_EXAMPLE_ACCEL="1", PYTHONUNBUFFERED="1"))
    try:
        out = read_until_listening(proc)
        assert "listening on http://127.0.0.1:" in out, out
        assert "example_accel: 1x Example Accelerator" in out
        assert re.search(r"decode attention\s+example_sdpa", out), out
        # the engine's startup notes come from the target's Platform
        assert "engine: example_accel defaults: chunked prefill 512" in out
        assert "graph capture off: the example_accel platform captures no decode graphs" in out
        url = f"http://127.0.0.1:{port}"
        status, _, raw = http_request(url, "POST", "/v1/chat/completions", {
            "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 12, "temperature": 0}, {}, timeout=300)
        assert status == 200, raw[:500]
        answer = json.loads(raw)["choices"][0]["message"]["content"]
        assert "Paris" in answer, answer
        status, _, raw = http_request(url, "GET", "/get_server_info", None, {}, timeout=60)
        assert json.loads(raw)["plan"]["device"]["target"] == "example_accel"
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
