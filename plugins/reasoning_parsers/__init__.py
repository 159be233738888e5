"""Built-in reasoning parsers (core.contract.reasoning): one module each, its capabilities beside
it."""
