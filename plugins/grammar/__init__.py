"""Built-in grammar backends (structured output): one package per backend (core.contract.grammar)."""
