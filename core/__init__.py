"""core: a plugin-based kernel-backend framework for LLM serving.

Folders by process and role (ARCHITECTURE.md): contract/ (what plugins import, with layers/),
plan/ (pure), messages.py (the process boundary), engine/ (the worker process), frontend/ (the
client side), server/ (HTTP).
"""

import importlib
import importlib.abc
import importlib.util
import sys

__version__ = "0.1.0"

# Where the flat modules of 0.1's first layout went. `import core.hookspecs` (a plugin package
# written before the re-plan) still works for one release, giving the very module now at its
# new name; core-serve 0.2.0 removes these names.
MOVED = {
    "hookspecs": "contract.hookspecs", "capabilities": "contract.capabilities",
    "attention": "contract.attention", "moe": "contract.moe", "quant": "contract.quant",
    "layer_ops": "contract.layer_ops", "platform": "contract.platform",
    "grammar": "contract.grammar", "tools": "contract.tools",
    "forward_batch": "contract.forward_batch",
    "config": "plan.args", "model_spec": "plan.model_spec", "devices": "plan.devices",
    "plugins": "plan.registry", "checks": "plan.checks", "resolver": "plan.resolver",
    "ipc": "messages",
}


class _MovedFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds `core.<old>` as the module `core.<new>` (MOVED), imported under its new name."""

    def find_spec(self, fullname, path=None, target=None):
        head, _, name = fullname.rpartition(".")
        if head != __name__ or name not in MOVED:
            return None
        spec = importlib.util.spec_from_loader(fullname, self)
        spec.loader_state = {"target": f"{__name__}.{MOVED[name]}"}
        return spec

    def create_module(self, spec):
        module = importlib.import_module(spec.loader_state["target"])
        spec.loader_state["spec"] = module.__spec__
        return module

    def exec_module(self, module):
        # the import system stamped the old name's spec on the module: give it back its own
        module.__spec__ = module.__spec__.loader_state["spec"]


if not any(type(f).__name__ == "_MovedFinder" for f in sys.meta_path):
    sys.meta_path.append(_MovedFinder())


def __getattr__(name):
    # The offline Engine is imported lazily so that `import core` stays cheap (no torch).
    if name == "Engine":
        from core.frontend.offline import Engine

        return Engine
    raise AttributeError(name)
