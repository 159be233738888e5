"""Plugin discovery and registration: validation, failure isolation, strict mode, env filters."""

from __future__ import annotations

import importlib.metadata as md

import pytest

from core.contract import hookspecs
from core.contract.capabilities import AttentionCaps, DeviceInfo, HardwareCaps, MoECaps
from core.contract.hookspecs import hookimpl
from core.plan import registry as plugins
from core.plan.registry import PluginError, build_registry


def _never_called(*args, **kwargs):
    raise NotImplementedError("test double: registration tests never build a backend")


class OneAttention:
    """A plugin registering one attention backend under a given name."""

    def __init__(self, name: str = "dup_like"):
        self.name = name

    @hookimpl
    def core_register_attention_backends(self, register):
        register(self.name, AttentionCaps(devices={"cpu"}), _never_called)


class FailsHalfway:
    """Registers a backend, then raises: the first registration must be rolled back."""

    @hookimpl
    def core_register_attention_backends(self, register):
        register("halfway_like", AttentionCaps(devices={"cpu"}), _never_called)
        raise RuntimeError("kernel table is corrupt")


class WrongCaps:
    @hookimpl
    def core_register_attention_backends(self, register):
        register("wrong_caps_like", MoECaps(devices={"cpu"}), _never_called)


class BadName:
    @hookimpl
    def core_register_moe_runners(self, register):
        register("has space", MoECaps(devices={"cpu"}), _never_called)


class BadFactory:
    @hookimpl
    def core_register_moe_runners(self, register):
        register("bad_factory_like", MoECaps(devices={"cpu"}), 42)


class FutureApi:
    CORE_PLUGIN_API = ">=2.0,<3"

    @hookimpl
    def core_register_attention_backends(self, register):
        register("future_like", AttentionCaps(devices={"cpu"}), _never_called)


class GarbledApi:
    CORE_PLUGIN_API = "version two please"


class ProbeRaises:
    @hookimpl
    def core_register_hardware(self, register):
        def probe():
            raise OSError("driver exploded")

        register("exploding_hw", HardwareCaps(device_type="cpu"), probe)


class ProbeLies:
    @hookimpl
    def core_register_hardware(self, register):
        register("lying_hw", HardwareCaps(device_type="cpu"), lambda: "not a DeviceInfo")


def in_process(*pairs, **kw):
    return build_registry(extra=list(pairs), entry_points=False, **kw)


@pytest.fixture
def restore_global_registry():
    yield
    plugins.get_registry(reload=True)  # env changes made by a test must not leak


# --------------------------------------------------------------------------- validation

def test_duplicate_name_rejected_naming_both_origins(clean_plugin_env):
    registry = in_process(("first", OneAttention()), ("second", OneAttention()))
    assert registry.get("attention", "dup_like").origin.plugin == "first"
    [failure] = registry.failures
    assert failure.stage == "register" and failure.origin.plugin == "second"
    assert "duplicate attention name 'dup_like'" in failure.error
    assert "<in-process> (first)" in failure.error and "<in-process> (second)" in failure.error


def test_duplicate_of_a_builtin_names_its_distribution(clean_plugin_env):
    registry = build_registry(extra=[("shadow", OneAttention("torch_native"))])
    dup = [f for f in registry.failures if f.origin.plugin == "shadow"]
    assert len(dup) == 1
    assert "core-serve" in dup[0].error and "attention_torch_native" in dup[0].error
    assert registry.get("attention", "torch_native").origin.dist == "core-serve"


def test_bad_caps_type_name_and_factory_are_rejected(clean_plugin_env):
    registry = in_process(("wrong", WrongCaps()), ("name", BadName()),
                          ("factory", BadFactory()))
    errors = {f.origin.plugin: f.error for f in registry.failures}
    assert "caps must be AttentionCaps, got MoECaps" in errors["wrong"]
    assert "invalid moe name 'has space'" in errors["name"]
    assert "factory must be callable or 'module:attr'" in errors["factory"]
    assert not registry.kind("attention") and not registry.kind("moe")


def test_api_range_mismatch_is_rejected_by_name(clean_plugin_env):
    registry = in_process(("future", FutureApi()), ("garbled", GarbledApi()),
                          ("fine", OneAttention()))
    errors = {f.origin.plugin: f for f in registry.failures}
    assert errors["future"].stage == "api"
    assert "'>=2.0,<3'" in errors["future"].error
    assert hookspecs.PLUGIN_API_VERSION in errors["future"].error
    assert "invalid CORE_PLUGIN_API" in errors["garbled"].error
    assert registry.get("attention", "future_like") is None
    assert registry.get("attention", "dup_like") is not None  # the others still load


# ------------------------------------------------------------------------ failure isolation

def test_register_failure_is_isolated_and_rolled_back(clean_plugin_env):
    registry = in_process(("halfway", FailsHalfway()), ("fine", OneAttention()))
    [failure] = registry.failures
    assert failure.stage == "register"
    assert failure.error == "RuntimeError: kernel table is corrupt"
    assert "Traceback" in failure.detail
    assert registry.get("attention", "halfway_like") is None  # rolled back
    assert registry.get("attention", "dup_like") is not None
    assert [o.plugin for o in registry.plugins] == ["fine"]


def test_import_failure_is_isolated_and_recorded(clean_plugin_env, monkeypatch):
    real = list(plugins._entry_points())
    broken = md.EntryPoint("broken_backend", "core_test_no_such_plugin_module",
                           hookspecs.ENTRY_POINT_GROUP)
    monkeypatch.setattr(plugins, "_entry_points", lambda: iter([broken, *real]))
    registry = build_registry()
    [failure] = [f for f in registry.failures if f.origin.plugin == "broken_backend"]
    assert failure.stage == "import"
    assert "ModuleNotFoundError" in failure.error
    assert "core_test_no_such_plugin_module" in failure.error
    assert registry.get("attention", "torch_native") is not None  # everything else loaded


def test_probe_failure_is_isolated(clean_plugin_env):
    registry = in_process(("exploding", ProbeRaises()), ("lying", ProbeLies()))
    info = registry.probe("exploding_hw")
    assert isinstance(info, DeviceInfo) and not info.available
    assert info.reason == "probe failed: OSError: driver exploded"
    lie = registry.probe("lying_hw")
    assert not lie.available and "not DeviceInfo" in lie.reason
    assert {(f.origin.plugin, f.stage) for f in registry.failures} == {("exploding", "probe"),
                                                                       ("lying", "probe")}
    assert registry.probe("exploding_hw") is info  # probed once


# --------------------------------------------------------------------------------- strict

def test_strict_mode_makes_failures_fatal(clean_plugin_env, monkeypatch):
    monkeypatch.setenv("CORE_STRICT_PLUGINS", "1")
    with pytest.raises(PluginError, match="kernel table is corrupt"):
        in_process(("halfway", FailsHalfway()))
    with pytest.raises(PluginError, match="failed at api"):
        in_process(("future", FutureApi()))
    registry = in_process(("exploding", ProbeRaises()))
    with pytest.raises(PluginError, match="driver exploded"):
        registry.probe("exploding_hw")


def test_strict_mode_off_values(clean_plugin_env, monkeypatch):
    monkeypatch.setenv("CORE_STRICT_PLUGINS", "0")
    assert in_process(("halfway", FailsHalfway())).failures  # recorded, not raised


# ------------------------------------------------------------------------------ env lists

def test_deny_list_by_entry_point_and_by_distribution(clean_plugin_env, monkeypatch):
    monkeypatch.setenv("CORE_PLUGINS_DENY", "attention_torch_native")
    registry = build_registry()
    assert registry.get("attention", "torch_native") is None
    assert registry.get("moe", "torch_native") is not None
    monkeypatch.setenv("CORE_PLUGINS_DENY", "core-serve")
    registry = build_registry()
    assert not any(o.dist == "core-serve" for o in registry.plugins)
    assert registry.get("quant", "unquantized") is None


def test_allow_list(clean_plugin_env, monkeypatch):
    monkeypatch.setenv("CORE_PLUGINS_ALLOW", "attention_torch_native, hardware_cpu")
    registry = build_registry()
    assert {o.plugin for o in registry.plugins} == {"attention_torch_native", "hardware_cpu"}
    assert set(registry.kind("attention")) == {"torch_native"}
    assert set(registry.kind("hardware")) == {"cpu"}
    assert not registry.kind("moe")


# ------------------------------------------------------------------------------ lifecycle

def test_get_registry_is_idempotent(clean_plugin_env, restore_global_registry):
    first = plugins.get_registry()
    assert plugins.get_registry() is first
    again = plugins.get_registry(reload=True)
    assert again is not first
    assert {k: set(v) for k, v in again.entries.items()} == \
        {k: set(v) for k, v in first.entries.items()}


def test_add_and_remove_an_in_process_plugin(clean_plugin_env, restore_global_registry):
    plugins.add_plugin("added", OneAttention("added_like"))
    try:
        assert plugins.get_registry().get("attention", "added_like") is not None
    finally:
        plugins.remove_plugin("added")
    assert plugins.get_registry().get("attention", "added_like") is None


def test_lazy_factory_is_imported_only_on_load(clean_plugin_env):
    registry = build_registry()
    reg = registry.get("attention", "torch_native")
    assert isinstance(reg.factory, str)  # declared as "module:attr", nothing imported yet
    assert reg.load().__name__ == reg.factory.rpartition(":")[2]
