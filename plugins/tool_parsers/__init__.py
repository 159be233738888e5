"""Built-in tool-call parsers (core.tools): one module each, its capabilities beside it."""
