"""core.plan.devices: simulated profiles, device selection, free memory, torch device strings."""

from __future__ import annotations

import dataclasses
import json

import pytest

from core.contract.capabilities import DeviceInfo, HardwareCaps
from core.contract.hookspecs import hookimpl
from core.plan.devices import (
    PROFILES,
    load_profile,
    profile_to_json,
    select_device,
    torch_device,
)
from core.plan.registry import build_registry
from plugins.hardware import cpu, cuda, rocm


@pytest.fixture(autouse=True)
def _plain_env(monkeypatch):
    for var in ("CORE_STRICT_PLUGINS", "CORE_PLUGINS_ALLOW", "CORE_PLUGINS_DENY"):
        monkeypatch.delenv(var, raising=False)


# ---------------------------------------------------------------------------------------------
# built-in profiles


@pytest.mark.parametrize("name", sorted(PROFILES))
def test_every_builtin_profile_loads(name):
    info = load_profile(name)
    assert isinstance(info, DeviceInfo)
    assert info.simulated and info.available and info.count == 1
    assert info.target in ("cuda", "rocm", "xpu", "npu", "cpu")
    assert info.device_type in ("cuda", "xpu", "npu", "cpu")
    assert info.memory_bytes > 2**30 and info.name and info.dist_backend
    assert "fp16" in info.features
    assert torch_device(info) == ("cpu" if info.target == "cpu" else f"{info.device_type}:0")
    # builtin profiles are JSON-clean
    json.dumps(profile_to_json(info))


def test_profiles_agree_with_the_probes_feature_rules():
    for name, info in PROFILES.items():
        if info.target == "cuda":
            assert info.features == cuda.features_for(info.capability), name
            assert info.arch == f"sm{info.capability}"
        elif info.target == "rocm":
            assert info.features == rocm.features_for(info.arch), name
        elif info.target == "cpu":
            assert info.features == cpu.features_for(info.features), name


def test_profile_datasheet_facts():
    h200, h100, a100 = PROFILES["h200"], PROFILES["h100"], PROFILES["a100"]
    assert h200.capability == 90 and h200.has("fp8")
    assert 139 * 2**30 < h200.memory_bytes < 141 * 2**30  # 141 GB sold, ~140 GiB reported
    assert h100.arch == "sm90" and 79 * 2**30 < h100.memory_bytes <= 80 * 2**30
    assert a100.has("bf16") and not a100.has("fp8")
    assert PROFILES["l4"].has("fp8") and PROFILES["l4"].capability == 89
    assert not PROFILES["t4"].has("bf16")
    mi = PROFILES["mi300x"]
    assert mi.target == "rocm" and mi.device_type == "cuda" and mi.arch == "gfx942"
    assert mi.has("fp8") and mi.memory_bytes == 192 * 2**30
    assert PROFILES["intel-max-1550"].has("xmx") and PROFILES["intel-max-1550"].device_type == "xpu"
    assert PROFILES["ascend-910b"].dist_backend == "hccl"
    xeon = PROFILES["xeon-amx"]
    assert {"amx_bf16", "amx_int8", "amx_tile", "avx512f", "avx512_bf16"} <= xeon.features
    plain = PROFILES["x86-cpu"]
    assert "avx2" in plain.features
    assert not {f for f in plain.features if f.startswith(("avx512", "amx"))}


def test_profile_name_with_count_suffix_and_case():
    info = load_profile("H200x8")
    assert info.count == 8 and info.name == PROFILES["h200"].name
    assert load_profile("intel-max-1550x2").count == 2
    assert load_profile(" mi300x ").arch == "gfx942"  # the name itself ends in x, no count
    assert torch_device(load_profile("h100x8"), 7) == "cuda:7"
    with pytest.raises(ValueError, match="count must be at least 1"):
        load_profile("h100x0")


def test_unknown_profile_name_lists_known_names():
    with pytest.raises(ValueError) as err:
        load_profile("h800")
    msg = str(err.value)
    assert "unknown device profile 'h800'" in msg
    for name in ("h200", "mi300x", "xeon-amx", "x86-cpu"):
        assert name in msg


# ---------------------------------------------------------------------------------------------
# JSON profiles


@pytest.mark.parametrize("name", sorted(PROFILES))
def test_json_profile_round_trip(tmp_path, name):
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(profile_to_json(PROFILES[name])))
    assert load_profile(str(path)) == PROFILES[name]


def test_probed_device_round_trips_as_simulated(tmp_path):
    real = cpu.probe()
    path = tmp_path / "host.json"
    path.write_text(json.dumps(profile_to_json(real)))
    loaded = load_profile(str(path))
    assert loaded.simulated and not real.simulated
    assert dataclasses.replace(loaded, simulated=False) == real


def test_minimal_json_profile(tmp_path):
    path = tmp_path / "gpu.json"
    path.write_text(json.dumps({"target": "cuda", "device_type": "cuda", "capability": 120,
                                "features": ["fp16", "bf16", "fp8", "fp4"],
                                "memory_bytes": 32 * 2**30, "name": "RTX 5090"}))
    info = load_profile(str(path))
    assert info.count == 1 and info.simulated and info.available
    assert info.features == {"fp16", "bf16", "fp8", "fp4"} and info.capability == 120


@pytest.mark.parametrize("content,match", [
    ("{not json", "invalid JSON"),
    ("[1, 2]", "expected a JSON object"),
    ('{"target": "cuda", "device_type": "cuda", "memory_gib": 80}',
     "unknown key.*memory_gib"),
    ('{"device_type": "cuda"}', "missing required key.*target"),
    ('{"target": "cuda"}', "missing required key.*device_type"),
    ('{"target": "", "device_type": "cuda"}', "'target' must be a non-empty string"),
    ('{"target": "cuda", "device_type": "cuda", "features": "fp8"}',
     "'features' must be a list of strings"),
    ('{"target": "cuda", "device_type": "cuda", "count": true}', "'count' must be"),
    ('{"target": "cuda", "device_type": "cuda", "count": 0}', "'count' must be at least 1"),
    ('{"target": "cuda", "device_type": "cuda", "memory_bytes": -1}', "'memory_bytes' must be"),
    ('{"target": "cuda", "device_type": "cuda", "capability": "sm90"}', "'capability' must be"),
    ('{"target": "cuda", "device_type": "cuda", "available": false}', "'available' must be true"),
    ('{"target": "cuda", "device_type": "cuda", "extra": [1]}', "'extra' must be an object"),
])
def test_bad_profile_files_give_clear_errors(tmp_path, content, match):
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=match) as err:
        load_profile(str(path))
    assert str(path) in str(err.value)  # the error names the file


def test_missing_profile_file(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_profile(str(tmp_path / "nope.json"))
    with pytest.raises(ValueError, match="name or a JSON file path"):
        load_profile("")


# ---------------------------------------------------------------------------------------------
# select_device


def _target(name, priority, available, device_type="cuda"):
    """An in-process hardware plugin with a fixed probe result."""
    info = DeviceInfo(target=name, device_type=device_type, available=available, count=1,
                      name=f"fake {name}", reason="" if available else f"{name} is switched off")

    class Plugin:
        @hookimpl
        def core_register_hardware(self, register):
            register(name, HardwareCaps(device_type=device_type, priority=priority), lambda: info)

    return (name, Plugin())


def _registry(*targets):
    return build_registry(extra=list(targets), entry_points=False)


def test_auto_selection_prefers_highest_priority_available():
    reg = _registry(_target("host", 0, True, "cpu"), _target("fast", 50, True),
                    _target("faster", 90, False), _target("slow", 10, True))
    info = select_device(reg)
    assert info.target == "fast"  # "faster" is unavailable, "slow" ranks lower
    assert select_device(reg, "auto").target == "fast"
    assert select_device(reg, "slow").target == "slow"


def test_auto_selection_falls_back_to_cpu_and_explains_when_nothing_fits():
    reg = _registry(_target("host", 0, True, "cpu"), _target("gpu", 100, False))
    assert select_device(reg).target == "host"
    none = _registry(_target("gpu", 100, False), _target("other", 5, False))
    with pytest.raises(ValueError, match="no hardware target is available") as err:
        select_device(none)
    assert "gpu is switched off" in str(err.value) and "other is switched off" in str(err.value)


def test_explicit_device_errors():
    reg = _registry(_target("host", 0, True, "cpu"), _target("gpu", 100, False))
    with pytest.raises(ValueError, match="unknown device 'tpu'.*gpu, host"):
        select_device(reg, "tpu")
    with pytest.raises(ValueError, match="device gpu is not available: gpu is switched off"):
        select_device(reg, "gpu")


def test_profile_wins_and_must_agree_with_device():
    reg = _registry(_target("host", 0, True, "cpu"))
    info = select_device(reg, profile="h100")
    assert info.simulated and info.name == PROFILES["h100"].name
    assert select_device(reg, device="rocm", profile="mi300x").target == "rocm"
    with pytest.raises(ValueError, match="conflicts with device profile 'mi300x'"):
        select_device(reg, device="cuda", profile="mi300x")


def test_select_on_this_machine_uses_the_real_plugins():
    reg = build_registry()
    chosen = select_device(reg)
    probes = reg.probe_all()
    available = [n for n, i in probes.items() if i.available]
    best = max(reg.kind("hardware")[n].caps.priority for n in available)
    assert chosen.available and reg.kind("hardware")[chosen.target].caps.priority == best
    assert select_device(reg, "cpu").target == "cpu"
    if not probes["cuda"].available:
        with pytest.raises(ValueError, match="device cuda is not available: .+"):
            select_device(reg, "cuda")


# ---------------------------------------------------------------------------------------------
# torch device strings


def test_torch_device_strings():
    assert torch_device(cpu.probe()) == "cpu"
    assert torch_device(load_profile("mi300x")) == "cuda:0"
    assert torch_device(load_profile("ascend-910bx8"), 5) == "npu:5"
    with pytest.raises(ValueError, match="out of range"):
        torch_device(load_profile("h100"), 1)
    with pytest.raises(ValueError, match="non-negative integer"):
        torch_device(load_profile("h100"), -1)
