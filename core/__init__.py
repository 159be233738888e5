"""core: a plugin-based kernel-backend framework for LLM serving."""

__version__ = "0.1.0"


def __getattr__(name):
    # The offline Engine is imported lazily so that `import core` stays cheap (no torch).
    if name == "Engine":
        from core.engine import Engine

        return Engine
    raise AttributeError(name)
