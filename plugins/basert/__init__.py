"""basert, Superfluid's own engine, in PyTorch and in-process: paged KV with prefix sharing,
one batched forward pass per step for every lane, prompt-lookup speculation, narrow (8/4-bit)
KV, and rows sampled on the device from two lanes up. The same code runs on CUDA, MPS and the
CPU; torch is imported only when a basert model is configured."""

from superfluid.core.errors import ConfigError
from superfluid.core.hookspecs import hookimpl

from .options import MAX_DRAFT, OPTIONS, parse_kv_bits, parse_speculate  # noqa: F401


@hookimpl
def superfluid_add_config(schema):
    OPTIONS.declare(schema)


def create_engine(*, model, config):
    """The engine factory: torch is imported here, when a basert model is configured, not when
    the daemon starts."""
    import importlib.util

    missing = [m for m in ("torch", "gguf", "safetensors") if importlib.util.find_spec(m) is None]
    if missing:
        raise ConfigError(f"model {model.name!r}: engine 'basert' needs {' and '.join(missing)} "
                          "(pip install 'superfluid[basert]'; on a CPU-only machine pin torch==2.13.0)")
    from .engine import BasertEngine

    return BasertEngine(model=model, config=config)


@hookimpl
def superfluid_add_engines(register):
    register("basert", create_engine)
