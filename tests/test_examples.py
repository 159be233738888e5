"""The example third-party plugins, installed the way a user installs them, seen by core-serve.

Each example distribution is pip-installed once into a temporary directory (never into the test
environment) and core-serve runs in subprocesses with that directory on PYTHONPATH, where
importlib.metadata finds its dist-info and so its `core.plugins` entry point. Without the
PYTHONPATH the package is, as far as core-serve can tell, uninstalled.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"
CONFIGS = REPO / "tests" / "fixtures" / "configs"

# Env vars that change what loads; the tests set them explicitly when they mean to.
CONTROL_VARS = ("CORE_STRICT_PLUGINS", "CORE_PLUGINS_ALLOW", "CORE_PLUGINS_DENY",
                "CORE_EXAMPLE_ACCEL")


def _install(tmp_path_factory: pytest.TempPathFactory, name: str) -> Path:
    """pip-install examples/<name> into a fresh directory and return that directory."""
    root = tmp_path_factory.mktemp(name)
    # Build from a copy so that setuptools' build/ and egg-info never land in the source tree.
    src = root / "src"
    shutil.copytree(EXAMPLES / name, src,
                    ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    site = root / "site"
    # --no-index + --no-build-isolation + --no-deps: uses the setuptools already installed and
    # never touches the network.
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
           "--no-index", "--no-deps", "--no-build-isolation", "--target", str(site), str(src)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, f"pip install of {name} failed:\n{proc.stdout}\n{proc.stderr}"
    return site


@pytest.fixture(scope="module")
def example_site(tmp_path_factory) -> Path:
    return _install(tmp_path_factory, "core-example-backend")


@pytest.fixture(scope="module")
def broken_site(tmp_path_factory) -> Path:
    return _install(tmp_path_factory, "core-broken-plugin")


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
from core.plugins import build_registry
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


# --- discovery through build_registry ---------------------------------------------------------

def test_installed_example_is_discovered_with_its_distribution(example_site):
    reg = _registry(example_site)
    sdpa = reg["entries"]["attention"]["example_sdpa"]
    assert (sdpa["dist"], sdpa["version"], sdpa["plugin"]) == \
        ("core-example-backend", "0.1.0", "example")
    assert reg["entries"]["hardware"]["example_accel"]["dist"] == "core-example-backend"
    # The built-in reference is still there beside it.
    assert reg["entries"]["attention"]["torch_native"]["dist"] == "core-serve"
    assert reg["example_sdpa_caps"] == {"page_sizes": ["set", [16]], "head_sizes": [64, 128],
                                        "sliding_window": False, "logit_softcap": False}
    assert not [f for f in reg["failures"] if f["dist"] == "core-example-backend"]
    assert reg["backend_imported"] is False


def test_example_accel_probe_follows_env_var(example_site):
    off = _registry(example_site)["example_accel"]
    assert off["available"] is False
    assert "CORE_EXAMPLE_ACCEL=1" in off["reason"]
    on = _registry(example_site, CORE_EXAMPLE_ACCEL="1")["example_accel"]
    assert on == {"available": True, "reason": "", "device_type": "cpu",
                  "name": "Example Accelerator"}


def test_uninstalled_example_is_absent():
    reg = _registry()
    assert "example_sdpa" not in reg["entries"]["attention"]
    assert "example_accel" not in reg["entries"]["hardware"]
    assert "torch_native" in reg["entries"]["attention"]


def test_deny_list_keeps_installed_example_out(example_site):
    reg = _registry(example_site, CORE_PLUGINS_DENY="core-example-backend")
    assert "example_sdpa" not in reg["entries"]["attention"]
    assert "torch_native" in reg["entries"]["attention"]


def test_broken_plugin_is_isolated(broken_site, example_site):
    reg = _registry(broken_site, example_site)
    broken = [f for f in reg["failures"] if f["dist"] == "core-broken-plugin"]
    assert len(broken) == 1
    assert broken[0]["plugin"] == "broken"
    assert broken[0]["stage"] == "import"
    assert "deliberately broken" in broken[0]["error"]
    # Everything else still loads, the other third-party plugin included.
    assert {"torch_native", "example_sdpa"} <= set(reg["entries"]["attention"])


def test_broken_plugin_is_fatal_in_strict_mode(broken_site):
    proc = _python(REGISTRY_DUMP, broken_site, CORE_STRICT_PLUGINS="1")
    assert proc.returncode != 0
    assert "PluginError" in proc.stderr
    assert "core-broken-plugin" in proc.stderr and "deliberately broken" in proc.stderr


# --- numerics: example_sdpa against torch_native and a dense reference ------------------------

# Runs one mixed extend step (requests with and without a cached prefix) and one decode step on
# a paged KV cache whose pages are scattered, through example_sdpa and through torch_native, each
# on its own pool, and through a dense float64 reference. Prints the largest differences.
NUMERICS = """
import dataclasses, json, torch
from core.attention import AttentionLayerParams, BackendContext
from core.forward_batch import ForwardBatch, ForwardMode
from core.kv_cache import KVPool
from core.plugins import build_registry

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
