"""Shared fixtures. Append new fixtures below; keep each one cheap and side-effect free.

Plugin registries here are built in-process (`build_registry(entry_points=False, extra=...)`) so
resolver tests see exactly the plugins they declare, whatever else is installed.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

TESTS_DIR = Path(__file__).resolve().parent
if str(TESTS_DIR) not in sys.path:  # helper modules (plugins_for_tests, ...) import by name
    sys.path.insert(0, str(TESTS_DIR))

CONFIGS_DIR = TESTS_DIR / "fixtures" / "configs"
PLUGIN_ENV_VARS = ("CORE_STRICT_PLUGINS", "CORE_PLUGINS_ALLOW", "CORE_PLUGINS_DENY")


@pytest.fixture
def clean_plugin_env(monkeypatch):
    """No strict mode and no allow/deny lists from the caller's environment."""
    for name in PLUGIN_ENV_VARS:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def configs_dir() -> Path:
    """tests/fixtures/configs: hand-written config.json files of public checkpoints."""
    return CONFIGS_DIR


@pytest.fixture(scope="session")
def model_spec():
    """load_model_spec by fixture name, e.g. model_spec("deepseek-v2-lite"); cached per session."""
    from core.plan.model_spec import load_model_spec

    cache = {}

    def load(name: str):
        if name not in cache:
            cache[name] = load_model_spec(str(CONFIGS_DIR / f"{name}.json"))
        return cache[name]

    return load


@pytest.fixture
def plain_registry(clean_plugin_env):
    """Only the built-in reference backends (torch_native attention/MoE, unquantized)."""
    from plugins_for_tests import builtin_backend_plugins

    from core.plan.registry import build_registry

    registry = build_registry(extra=builtin_backend_plugins(), entry_points=False)
    assert not registry.failures, registry.failures
    return registry


@pytest.fixture
def test_registry(clean_plugin_env):
    """The built-in reference backends plus every SGLang-shaped test double."""
    from plugins_for_tests import builtin_backend_plugins, double_plugins

    from core.plan.registry import build_registry

    registry = build_registry(extra=builtin_backend_plugins() + double_plugins(),
                              entry_points=False)
    assert not registry.failures, registry.failures
    return registry


@pytest.fixture
def global_test_plugins(clean_plugin_env):
    """The test doubles added to the process-wide registry (core.plan.registry.get_registry), then
    removed again, for code that looks plugins up itself (the CLI)."""
    from plugins_for_tests import double_plugins

    from core.plan import registry as plugins

    added = double_plugins()
    for name, plugin in added:
        plugins.add_plugin(name, plugin)
    try:
        yield plugins.get_registry()
    finally:
        for name, _ in added:
            plugins.remove_plugin(name)
