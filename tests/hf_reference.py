"""The Hugging Face transformers reference for the embedded SmolLM2 GGUF (tests and bench).

transformers' `from_pretrained(dir, gguf_file=...)` needs accelerate (not a dependency here) only
for device placement; this builds the same model the same way: the config from the GGUF, the
model class from the config, the tensors through transformers' own GGUF reader (dequantized).

transformers' GGUF path takes 20-60 s on a 2-core box for this 135M model (its reader parses the
49k-token vocabulary per call, and its name map is rebuilt per module), so the config and the
dequantized tensors are kept for the process: every call still builds a fresh model of its own
(callers may wrap or change it) from transformers' own conversion of the file.
"""

from __future__ import annotations

import contextlib
import copy
import os

import torch

_CONVERTED: dict[tuple[str, float, int], tuple[object, dict[str, torch.Tensor]]] = {}


def _converted(path: str) -> tuple[object, dict[str, torch.Tensor]]:
    """transformers' config and dequantized tensors of the GGUF file (once per process)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from core.engine.loader import shared_gguf_reader

    key = (os.path.realpath(path), os.path.getmtime(path), os.path.getsize(path))
    if key not in _CONVERTED:
        directory, name = os.path.split(path)
        with shared_gguf_reader(path):  # one parse of the file for both calls
            config = AutoConfig.from_pretrained(directory, gguf_file=name)
            model = AutoModelForCausalLM.from_config(config)
            tensors = load_gguf_checkpoint(path, return_tensors=True,
                                           model_to_load=model)["tensors"]
        _CONVERTED[key] = (config, tensors)
    return _CONVERTED[key]


def hf_gguf_model(path: str, dtype: torch.dtype = torch.float32):
    """A fresh transformers model of the GGUF file in `dtype`, eval mode, tied embeddings."""
    from transformers import AutoModelForCausalLM

    config, tensors = _converted(path)
    try:  # its random init is overwritten below (transformers >= 5 has this context)
        from transformers.initialization import no_init_weights
    except ImportError:
        no_init_weights = contextlib.nullcontext
    with no_init_weights():
        model = AutoModelForCausalLM.from_config(copy.deepcopy(config), dtype=dtype)
    missing, unexpected = model.load_state_dict({k: v.to(dtype) for k, v in tensors.items()},
                                                strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise ValueError(f"GGUF tensors do not fit {type(model).__name__}: missing {missing}, "
                         f"unexpected {unexpected}")
    model.tie_weights()
    return model.eval()
