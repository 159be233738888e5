"""Built-in LoRA backends (core.contract.lora)."""
