"""pytest plugin: run the attention-backend or MoE-runner conformance suite against a named
backend.

Installed with core-serve as a `pytest11` entry point, so it is loaded in every pytest run of an
environment that has core-serve; it does nothing unless asked (its options have their own prefix,
so it cannot clash with another project's). A backend package checks its backend with

    pytest --conformance-backend my_backend                 # cpu, plus cuda cases if present
    pytest --conformance-backend my_backend -m gpu --conformance-full   # accelerator, full shapes

or, where core-serve is importable but not installed as a distribution,

    pytest -p conformance.plugin --backend my_backend

(`--backend` exists only when the plugin is requested with -p, for the same no-clash reason).
The option adds the suite (conformance/attention_suite.py) to whatever else pytest collects.
A MoE runner is checked the same way, with `--conformance-moe NAME`, which adds
conformance/moe_suite.py (a Triton runner on a CPU: set TRITON_INTERPRET=1), and a layer-ops
plugin with `--conformance-layer-ops NAME` (conformance/layer_ops_suite.py), a quant method
with `--conformance-quant NAME` (conformance/quant_suite.py), a grammar backend with
`--conformance-grammar NAME` (conformance/grammar_suite.py), a tool-call parser with
`--conformance-tool-parser NAME` (conformance/tool_parser_suite.py; no torch, seconds), a
speculative proposer with `--conformance-spec NAME` (conformance/spec_suite.py; seconds), a
reasoning parser with `--conformance-reasoning-parser NAME` (conformance/reasoning_parser_suite.py;
no torch, seconds), a LoRA backend with `--conformance-lora NAME` (conformance/lora_suite.py;
seconds), and a hardware target's Platform with `--conformance-platform TARGET`
(conformance/platform_suite.py).
Options (each NAME option repeatable or a comma list): --conformance-backend NAME,
--conformance-moe NAME, --conformance-layer-ops NAME, --conformance-quant NAME,
--conformance-grammar NAME, --conformance-tool-parser NAME, --conformance-spec NAME,
--conformance-reasoning-parser NAME, --conformance-lora NAME, --conformance-platform TARGET,
--conformance-device DEV (repeatable; default cpu plus cuda when present), --conformance-full,
--conformance-seed N.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from core.plan.registry import Registration, Registry

PLUGIN = "conformance.plugin"
# Its name until 0.1 (`-p core.testing.conformance`, or `pytest_plugins` in a conftest): the
# deprecated core.testing alias gives this very module under it, until 0.2 removes the alias.
OLD_PLUGIN = "core.testing.conformance"
NAMES = (PLUGIN, OLD_PLUGIN)
HERE = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Suite:
    """One conformance suite: the option that selects what it checks, and its test module."""

    option: str  # the --conformance-... flag
    module: str  # conformance.<module>
    metavar: str
    help: str

    @property
    def dest(self) -> str:
        return self.option.lstrip("-").replace("-", "_")

    @property
    def path(self) -> Path:
        return HERE / f"{self.module}.py"


# The suites are not imported here: this module loads in every pytest run of the environment
# and must stay cheap (the suites import torch).
SUITES = (
    Suite("--conformance-backend", "attention_suite", "NAME",
          "run the attention conformance suite on this registered backend (repeatable)"),
    Suite("--conformance-mla", "mla_suite", "NAME",
          "run the MLA attention conformance suite (fp32/fp16/bf16, absorbed == materialised) on "
          "this registered MLA backend (repeatable)"),
    Suite("--conformance-moe", "moe_suite", "NAME",
          "run the MoE-runner conformance suite on this registered runner (repeatable)"),
    Suite("--conformance-layer-ops", "layer_ops_suite", "NAME",
          "run the layer-ops conformance suite on this registered plugin (repeatable)"),
    Suite("--conformance-quant", "quant_suite", "NAME",
          "run the quant-method conformance suite on this registered method (repeatable; "
          "needs the compressed-tensors package)"),
    Suite("--conformance-grammar", "grammar_suite", "NAME",
          "run the grammar-backend conformance suite on this registered backend (repeatable)"),
    Suite("--conformance-tool-parser", "tool_parser_suite", "NAME",
          "run the tool-call-parser conformance suite on this registered parser (repeatable, "
          "or a comma list)"),
    Suite("--conformance-spec", "spec_suite", "NAME",
          "run the speculative-proposer conformance suite on this registered proposer "
          "(repeatable, or a comma list; host only, seconds)"),
    Suite("--conformance-reasoning-parser", "reasoning_parser_suite", "NAME",
          "run the reasoning-parser conformance suite on this registered parser (repeatable, "
          "or a comma list)"),
    Suite("--conformance-lora", "lora_suite", "NAME",
          "run the LoRA-backend conformance suite (mixed adapters, ranks 8-64, fused outputs, "
          "each rank's part at a simulated tp 2 and 4, against an fp32 reference) on this "
          "registered backend (repeatable, or a comma list)"),
    Suite("--conformance-platform", "platform_suite", "TARGET",
          "run the Platform conformance suite on this registered hardware target "
          "(repeatable)"),
)
SUITE_MODULES = tuple(f"conformance.{suite.module}" for suite in SUITES)


def named_plugins(config: pytest.Config, kind: str, option: str, label: str
                  ) -> tuple[Registry, dict[str, Registration], list[str]]:
    """(registry, its `kind` plugins, the names the suite option selected): each name once
    (an addopts default plus the command line is still one run), an option given several
    times or as a comma list (`--conformance-moe a,b`); UsageError for an unregistered name.
    Shared by every suite (the registry is imported here, not when pytest loads the plugin)."""
    from core.plan.registry import get_registry

    registry = get_registry()
    plugins = registry.kind(kind)
    given = config.getoption(option, default=None) or []
    named = list(dict.fromkeys(n.strip() for v in given for n in v.split(",") if n.strip()))
    unknown = [n for n in named if n not in plugins]
    if unknown:
        raise pytest.UsageError(f"{label}(s) {', '.join(unknown)} not registered "
                                f"(registered: {', '.join(sorted(plugins)) or 'none'})")
    return registry, plugins, named


def pytest_addoption(parser: pytest.Parser, pluginmanager: pytest.PytestPluginManager) -> None:
    if _blocked_by_other_name(pluginmanager):
        return  # being unregistered (pytest_plugin_registered): no options of a plugin not run
    group = parser.getgroup("core-conformance", "core-serve attention backend conformance")
    for suite in SUITES:
        group.addoption(suite.option, action="append", dest=suite.dest, metavar=suite.metavar,
                        default=None, help=suite.help)
    group.addoption("--conformance-device", action="append", dest="conformance_device",
                    metavar="DEVICE", default=None,
                    help="torch device for the suite (repeatable; default cpu, plus cuda "
                         "when available)")
    group.addoption("--conformance-full", action="store_true", dest="conformance_full",
                    help="full-size conformance shapes (meant for an accelerator)")
    group.addoption("--conformance-seed", type=int, dest="conformance_seed", default=0,
                    metavar="N", help="base seed of the conformance inputs (default 0)")


def _blocked_by_other_name(manager: pytest.PytestPluginManager) -> bool:
    """`-p no:core.testing.conformance` while the entry point loads `conformance.plugin` (or
    the other way round): the user turned the plugin off under the name they know."""
    name = manager.get_name(sys.modules[__name__])
    return any(manager.is_blocked(n) for n in NAMES if n != name)


class _OtherName:
    """Holds this plugin's other name in pytest's plugin manager: nothing to call, but pytest
    then skips an entry point or a `-p` under that name (see pytest_plugin_registered)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"<{self.name}: the {PLUGIN} module, registered under its other name>"


def pytest_plugin_registered(plugin: object, manager: pytest.PytestPluginManager) -> None:
    """This module under one of its names holds the other one, so that it registers once
    whichever name comes first: the pytest11 entry point (`conformance.plugin`), an old
    `-p core.testing.conformance` or a conftest's `pytest_plugins` naming it (the same module
    object, through the core.testing alias). pluggy refuses one object under two names, and a
    second copy would add every option twice. `-p no:` under either name still disables it."""
    if plugin is not sys.modules[__name__]:
        return
    name = manager.get_name(plugin)
    if _blocked_by_other_name(manager):
        manager.set_blocked(name)
        return
    for other in NAMES:
        if other != name and manager.get_plugin(other) is None:
            manager.register(_OtherName(other), other)


def _requested_with_p(early_config: pytest.Config, args: list[str]) -> bool:
    plugins = getattr(early_config.known_args_namespace, "plugins", None) or []
    return any(n in plugins or f"-p{n}" in args for n in NAMES)


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests(early_config: pytest.Config, parser: pytest.Parser,
                                  args: list[str]) -> None:
    # `--backend` is a common name; claim it only when the plugin was asked for explicitly.
    if _requested_with_p(early_config, args):
        parser.addoption("--backend", action="append", dest="conformance_backend",
                         metavar="NAME", default=None,
                         help="same as --conformance-backend")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs an accelerator (run with -m gpu)")
    args = [str(Path(a.split("::")[0]).resolve()) for a in config.args]
    for suite in SUITES:
        if config.getoption(suite.dest, default=None) and str(suite.path) not in args:
            config.args.append(str(suite.path))
            config._core_conformance_injected = True  # noqa: SLF001 - our own marker


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """When the suite was added by the option, drop copies of it that a test module imported
    (the injected copy runs the same cases)."""
    if not getattr(config, "_core_conformance_injected", False):
        return
    keep, drop = [], []
    for item in items:
        fn = getattr(item, "function", None)
        module = getattr(getattr(item, "module", None), "__name__", "")
        origin = getattr(fn, "__module__", "")
        is_copy = origin in SUITE_MODULES and module != origin
        (drop if is_copy else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
