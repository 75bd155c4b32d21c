"""MLX through mlx-lm's model call and KV cache classes, in a supervised worker process."""

from superfluid.core.hookspecs import hookimpl


@hookimpl
def superfluid_add_engines(registry):
    from .engine import MlxEngine
    registry.add("mlx", MlxEngine)
