"""Built-in tool-call parsers (core.contract.tools): one module each, its capabilities beside it."""
