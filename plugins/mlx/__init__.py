"""MLX through mlx-lm's model call and KV cache classes, in a supervised worker process."""

from superfluid.core.hookspecs import hookimpl


@hookimpl
def superfluid_add_engines(register):
    from .engine import MlxEngine
    register("mlx", MlxEngine)
