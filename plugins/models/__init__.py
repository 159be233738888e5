"""Built-in model architectures, registered as a `models` plugin like any other."""

from core.contract.capabilities import ModelCaps
from core.contract.hookspecs import hookimpl

CORE_PLUGIN_API = ">=1.10,<2"

# name -> (architectures served, "module:class"); filled in as architectures land.
BUILTIN: dict[str, tuple[tuple[str, ...], str]] = {
    "llama": (("LlamaForCausalLM",), "plugins.models.llama:LlamaForCausalLM"),
    "mistral": (("MistralForCausalLM",), "plugins.models.mistral:MistralForCausalLM"),
    "qwen2": (("Qwen2ForCausalLM",), "plugins.models.qwen2:Qwen2ForCausalLM"),
    "qwen3": (("Qwen3ForCausalLM",), "plugins.models.qwen3:Qwen3ForCausalLM"),
    "mixtral": (("MixtralForCausalLM",), "plugins.models.mixtral:MixtralForCausalLM"),
    "qwen2_moe": (("Qwen2MoeForCausalLM",), "plugins.models.qwen2_moe:Qwen2MoeForCausalLM"),
    "qwen3_moe": (("Qwen3MoeForCausalLM",), "plugins.models.qwen3_moe:Qwen3MoeForCausalLM"),
    "gemma2": (("Gemma2ForCausalLM",), "plugins.models.gemma:Gemma2ForCausalLM"),
    "gemma3": (("Gemma3ForCausalLM",), "plugins.models.gemma:Gemma3ForCausalLM"),
    "deepseek_v2": (("DeepseekV2ForCausalLM",),
                    "plugins.models.deepseek_v2:DeepseekV2ForCausalLM"),
    "deepseek_v3": (("DeepseekV3ForCausalLM",),
                    "plugins.models.deepseek_v2:DeepseekV3ForCausalLM"),
    "gpt_oss": (("GptOssForCausalLM",), "plugins.models.gpt_oss:GptOssForCausalLM"),
}
# implementations whose attention is multi-head latent attention (core.contract.mla)
MLA_MODELS = frozenset({"deepseek_v2", "deepseek_v3"})
# implementations that take LoRA adapters (LlamaForCausalLM.lora_targets), on these projections
LORA_MODELS = frozenset({"llama", "mistral", "qwen2", "qwen3"})
LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@hookimpl
def core_register_models(register):
    for name, (archs, factory) in BUILTIN.items():
        kinds = {"MLA"} if name in MLA_MODELS else {"MHA", "GQA", "MQA"}
        lora = LORA_MODULES if name in LORA_MODELS else ()
        register(name, ModelCaps(architectures=set(archs), attention_kinds=kinds,
                                 lora_modules=lora), factory)
