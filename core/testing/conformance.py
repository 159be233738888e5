"""pytest plugin: run the attention-backend or MoE-runner conformance suite against a named
backend.

Installed with core-serve as a `pytest11` entry point, so it is loaded in every pytest run of an
environment that has core-serve; it does nothing unless asked (its options have their own prefix,
so it cannot clash with another project's). A backend package checks its backend with

    pytest --conformance-backend my_backend                 # cpu, plus cuda cases if present
    pytest --conformance-backend my_backend -m gpu --conformance-full   # accelerator, full shapes

or, where core-serve is importable but not installed as a distribution,

    pytest -p core.testing.conformance --backend my_backend

(`--backend` exists only when the plugin is requested with -p, for the same no-clash reason).
The option adds the suite (core/testing/attention_suite.py) to whatever else pytest collects.
A MoE runner is checked the same way, with `--conformance-moe NAME`, which adds
core/testing/moe_suite.py (a Triton runner on a CPU: set TRITON_INTERPRET=1), and a layer-ops
plugin with `--conformance-layer-ops NAME` (core/testing/layer_ops_suite.py), a quant method
with `--conformance-quant NAME` (core/testing/quant_suite.py), and a hardware
target's Platform with `--conformance-platform TARGET` (core/testing/platform_suite.py).
Options: --conformance-backend NAME (repeatable), --conformance-moe NAME (repeatable),
--conformance-layer-ops NAME (repeatable), --conformance-quant NAME (repeatable),
--conformance-platform TARGET (repeatable),
--conformance-device DEV (repeatable; default cpu plus cuda when present), --conformance-full,
--conformance-seed N.
"""

from __future__ import annotations

from pathlib import Path

import pytest

PLUGIN = "core.testing.conformance"
# Not imported here: this module loads in every pytest run of the environment and must stay
# cheap (the suite imports torch).
SUITE_MODULE = "core.testing.attention_suite"
SUITE_PATH = Path(__file__).resolve().with_name("attention_suite.py")
MOE_SUITE_MODULE = "core.testing.moe_suite"
MOE_SUITE_PATH = Path(__file__).resolve().with_name("moe_suite.py")
OPS_SUITE_MODULE = "core.testing.layer_ops_suite"
OPS_SUITE_PATH = Path(__file__).resolve().with_name("layer_ops_suite.py")
QUANT_SUITE_MODULE = "core.testing.quant_suite"
QUANT_SUITE_PATH = Path(__file__).resolve().with_name("quant_suite.py")
PLATFORM_SUITE_MODULE = "core.testing.platform_suite"
PLATFORM_SUITE_PATH = Path(__file__).resolve().with_name("platform_suite.py")


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("core-conformance", "core-serve attention backend conformance")
    group.addoption("--conformance-backend", action="append", dest="conformance_backend",
                    metavar="NAME", default=None,
                    help="run the attention conformance suite on this registered backend "
                         "(repeatable)")
    group.addoption("--conformance-moe", action="append", dest="conformance_moe",
                    metavar="NAME", default=None,
                    help="run the MoE-runner conformance suite on this registered runner "
                         "(repeatable)")
    group.addoption("--conformance-layer-ops", action="append", dest="conformance_layer_ops",
                    metavar="NAME", default=None,
                    help="run the layer-ops conformance suite on this registered plugin "
                         "(repeatable)")
    group.addoption("--conformance-quant", action="append", dest="conformance_quant",
                    metavar="NAME", default=None,
                    help="run the quant-method conformance suite on this registered method "
                         "(repeatable; needs the compressed-tensors package)")
    group.addoption("--conformance-platform", action="append", dest="conformance_platform",
                    metavar="TARGET", default=None,
                    help="run the Platform conformance suite on this registered hardware "
                         "target (repeatable)")
    group.addoption("--conformance-device", action="append", dest="conformance_device",
                    metavar="DEVICE", default=None,
                    help="torch device for the suite (repeatable; default cpu, plus cuda "
                         "when available)")
    group.addoption("--conformance-full", action="store_true", dest="conformance_full",
                    help="full-size conformance shapes (meant for an accelerator)")
    group.addoption("--conformance-seed", type=int, dest="conformance_seed", default=0,
                    metavar="N", help="base seed of the conformance inputs (default 0)")


def _requested_with_p(early_config: pytest.Config, args: list[str]) -> bool:
    plugins = getattr(early_config.known_args_namespace, "plugins", None) or []
    return PLUGIN in plugins or f"-p{PLUGIN}" in args


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
    for option, path in (("conformance_backend", SUITE_PATH),
                         ("conformance_moe", MOE_SUITE_PATH),
                         ("conformance_layer_ops", OPS_SUITE_PATH),
                         ("conformance_quant", QUANT_SUITE_PATH),
                         ("conformance_platform", PLATFORM_SUITE_PATH)):
        if config.getoption(option, default=None) and str(path) not in args:
            config.args.append(str(path))
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
        is_copy = origin in (SUITE_MODULE, MOE_SUITE_MODULE, OPS_SUITE_MODULE,
                             QUANT_SUITE_MODULE, PLATFORM_SUITE_MODULE) and module != origin
        (drop if is_copy else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
