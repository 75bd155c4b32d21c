"""llama.cpp through llama-cpp-python's low-level API, in a supervised worker process."""

from superfluid.core.hookspecs import hookimpl

from .options import FLASH_ATTN, OPTIONS  # noqa: F401  (FLASH_ATTN: the engine's, by its old name too)


@hookimpl
def superfluid_add_config(schema):
    OPTIONS.declare(schema)


@hookimpl
def superfluid_add_engines(register):
    from .engine import LlamaCppEngine
    register("llamacpp", LlamaCppEngine)
