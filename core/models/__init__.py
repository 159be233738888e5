"""Built-in model architectures, registered as a `models` plugin like any other."""

from core.capabilities import ModelCaps
from core.hookspecs import hookimpl

CORE_PLUGIN_API = ">=1.0,<2"

# name -> (architectures served, "module:class"); filled in as architectures land.
BUILTIN: dict[str, tuple[tuple[str, ...], str]] = {}


@hookimpl
def core_register_models(register):
    for name, (archs, factory) in BUILTIN.items():
        register(name, ModelCaps(architectures=set(archs)), factory)
