"""The Hugging Face transformers reference for the embedded SmolLM2 GGUF (tests and bench).

transformers' `from_pretrained(dir, gguf_file=...)` needs accelerate (not a dependency here) only
for device placement; this builds the same model the same way: the config from the GGUF, the
model class from the config, the tensors through transformers' own GGUF reader (dequantized).
"""

from __future__ import annotations

import os

import torch


def hf_gguf_model(path: str, dtype: torch.dtype = torch.float32):
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    directory, name = os.path.split(path)
    config = AutoConfig.from_pretrained(directory, gguf_file=name)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    tensors = load_gguf_checkpoint(path, return_tensors=True, model_to_load=model)["tensors"]
    missing, unexpected = model.load_state_dict({k: v.to(dtype) for k, v in tensors.items()},
                                                strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise ValueError(f"GGUF tensors do not fit {type(model).__name__}: missing {missing}, "
                         f"unexpected {unexpected}")
    model.tie_weights()
    return model.eval()
