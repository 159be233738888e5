"""The plan: server args, model spec (from the config alone), GGUF metadata, devices, the plugin
registry, checks, slots, the resolver and the plan it returns. Pure: imports no torch (tested),
so a plan for any device can be made anywhere."""
