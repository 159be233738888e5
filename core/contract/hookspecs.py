"""The plugin API: the hooks a `core.plugins` entry point may implement.

A plugin module (or object) implements any of these with `@hookimpl` and may state the API
versions it supports with a module attribute, a PEP 440 specifier against PLUGIN_API_VERSION:

    CORE_PLUGIN_API = ">=1.0,<2"

Every hook receives one keyword argument, `register`, a callback owned by the core:

    register(name: str, caps: <Caps dataclass>, factory: Callable | "module:attr")

`factory` is only imported/called when the backend is chosen, so declaring capabilities never
imports a kernel library. The core validates every call, rejects duplicate names (naming both
distributions) and records which distribution registered what.
"""

from __future__ import annotations

import pluggy

PROJECT = "core"
PLUGIN_API_VERSION = "1.12"  # 1.1: hardware targets may register a Platform; layer ops
# 1.2: quant factories take the checkpoint's QuantScheme (core.contract.quant); QuantCaps formats
# 1.3: grammar backends (structured output, core.contract.grammar)
# 1.4: QuantCaps.programs; quant methods may load tensors themselves (weight_loader,
#      load_table, takes_raw_gguf: core.contract.quant)
# 1.5: tool-call parsers (tool calling in chat, core.contract.tools)
# 1.6: GrammarCaps.jump_forward; grammar matchers may implement jump_forward()
# 1.7: GrammarCaps.serialize (grammar backends' serialize / deserialize: compiles run in a
#      child process, core.engine.grammar_compiler)
# 1.8: QuantMethod and Platform are base classes (core.contract.quant / .platform): a method
#      or platform that does not subclass them is refused at load; QuantCaps.online_activations
#      (online weight-only methods); BasePlatform.zeros / host_device / dist_bind / dist_device
# 1.9: speculative-decoding proposers (core_register_spec_proposers, SpecCaps, core.contract.spec)
#      and reasoning parsers (reasoning_content in chat, core.contract.reasoning)
# 1.10: LoRA backends (core_register_lora_backends, LoRACaps, core.contract.lora);
#       ModelCaps.lora_modules; ToolParserCaps.reads (special-token markers a tool parser
#       reads, kept when detokenizing); MoECaps.expert_bias and the "swigluoai" activation
#       (core.contract.moe: GPT-OSS's experts)
# 1.11: draft-model proposers: SpecConfig.draft, the engine's DraftModel (core.contract.spec),
#       given to proposers whose SpecCaps say needs_draft_weights
# 1.12: the optional layer op rotary_mla (core.contract.layer_ops: MLA's q and k rope in one)
ENTRY_POINT_GROUP = "core.plugins"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def core_register_hardware(register):
    """Register hardware targets: register(name, HardwareCaps, probe, platform=None).

    `probe()` returns a DeviceInfo saying honestly what is installed and present (available=False
    with a reason when not); it must not raise for absent hardware. `platform` (callable or
    "module:attr", imported only on that target) builds the target's runtime from the DeviceInfo:
    a core.contract.platform.Platform (memory, defaults, copies, graphs, post-load transforms, overlap).
    """


@hookspec
def core_register_attention_backends(register):
    """Register attention backends: register(name, AttentionCaps, factory).

    `factory(ctx: core.contract.attention.BackendContext)` returns an object implementing
    core.contract.attention.AttentionBackend; one declaring the "MLA" attention kind returns a
    core.contract.mla.MLAAttentionBackend (the latent cache, absorbed / materialised forms).
    """


@hookspec
def core_register_moe_runners(register):
    """Register MoE runners: register(name, MoECaps, factory); factory builds a runner with one
    `forward`."""


@hookspec
def core_register_quant_methods(register):
    """Register quantization methods: register(name, QuantCaps, factory); factory(scheme)
    (a core.contract.quant.QuantScheme) returns a method that creates weights, post-processes them after
    loading and applies them (the protocol is core.contract.quant)."""


@hookspec
def core_register_models(register):
    """Register model architectures: register(name, ModelCaps, factory); factory(config) returns
    a torch.nn.Module implementing the architectures named in ModelCaps."""


@hookspec
def core_register_layer_ops(register):
    """Register layer ops: register(name, LayerOpsCaps, factory); factory(dtype=, device=)
    returns an object implementing core.contract.layer_ops.LayerOps (fused element-wise kernels)."""


@hookspec
def core_register_grammar_backends(register):
    """Register grammar backends (structured output): register(name, GrammarCaps, factory);
    factory(tokenizer=, vocab_size=, stop_token_ids=) returns a core.contract.grammar.GrammarBackend
    (constraint -> compiled grammar -> per-request matcher filling a token bitmask)."""


@hookspec
def core_register_tool_parsers(register):
    """Register tool-call parsers (tool calling in chat): register(name, ToolParserCaps,
    factory); factory() returns a core.contract.tools.ToolParser (model output text -> content and
    tool calls; the tools offered in a system message for templates that ignore them)."""


@hookspec
def core_register_spec_proposers(register):
    """Register speculative-decoding proposers: register(name, SpecCaps, factory);
    factory(config: core.contract.spec.SpecConfig) returns a core.contract.spec.Proposer
    (drafts for a batch from each request's tokens; told what was accepted; reset per request).
    A proposer with SpecCaps.needs_draft_weights gets the engine's draft model as
    SpecConfig.draft (core.contract.spec.DraftModel). The engine verifies the drafts exactly
    (greedy match, rejection sampling)."""


@hookspec
def core_register_reasoning_parsers(register):
    """Register reasoning parsers (reasoning_content in chat): register(name,
    ReasoningParserCaps, factory); factory() returns a core.contract.reasoning.ReasoningParser
    (model output text -> reasoning and content, whole or streamed)."""


@hookspec
def core_register_lora_backends(register):
    """Register LoRA backends (multi-LoRA serving): register(name, LoRACaps, factory);
    factory(config: core.contract.lora.LoRAConfig) returns a core.contract.lora.LoRABackend
    (per step, the batch's tokens grouped by adapter slot; per projection, adds
    scale * x @ A @ B of each token's adapter to the base output, fused outputs by slice)."""
