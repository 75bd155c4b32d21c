"""llama.cpp through llama-cpp-python's low-level API, in a supervised worker process."""

from superfluid.core.hookspecs import hookimpl


@hookimpl
def superfluid_add_engines(registry):
    from .engine import LlamaCppEngine
    registry.add("llamacpp", LlamaCppEngine)
