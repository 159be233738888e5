"""The plugin contract: hookspecs, capability types and each plugin kind's protocol (attention,
moe, quant, layer_ops, platform, grammar, tools). With core.layers, the only core modules a
plugin imports."""
