"""The MLX worker process: loads the model and runs ticks sent over a pipe.

As with llama.cpp, the runtime lives in a process of its own: a crash or a kill takes only the
worker; the daemon sees the pipe close, restarts it, and the lanes resume from their tokens."""

from __future__ import annotations

import os

import attrs

from superfluid.core.stop_flag import StopFlag
from superfluid.core.worker_process import serve_ticks

from .constants import PREFILL_STEP


@attrs.define(frozen=True)
class WorkerSpec:
    """Everything the worker needs (decided in the daemon)."""

    path: str
    max_lanes: int
    max_context: int
    eog: frozenset
    step_tokens: int = PREFILL_STEP
    vision: bool = False  # a SmolVLM directory: the vision half loads through mlx-vlm (vision.py)
    pool_cells: int = 0   # a shared pool's cells (--kv-pool-cells; 0: lanes × context, capped)
    shared_pool_fraction: float = 0.6
    image_encoding: str = "admission"  # images encode on a background thread ("tick": on the tick)
    kv_bits: int = 0      # 8 or 4: mlx-lm's QuantizedKVCache on every layer (kv_cells); 0: full width
    rope: dict = attrs.field(factory=dict)  # rope_scaling / rope_theta laid over the model's config (rope_config)


def logit_rows(model) -> int | None:
    """The length of the model's logits row (its ``vocab_size``; None where it does not say)."""
    return int(getattr(getattr(model, "args", None), "vocab_size", 0) or 0) or None


def main(conn, stop_flag: StopFlag, spec: WorkerSpec) -> None:
    """Worker entry point (spawned); the protocol is core.worker_process's."""
    try:
        import mlx.core as mx

        from . import kv_cells, loader, pool
        from superfluid.plugins.vocab.constraints import VocabConstrainer
        from .runner import MlxRunner

        conn.send(("progress", 0))
        encoder = None
        if spec.vision:
            from . import vision

            model, encoder = vision.load(spec.path, spec.rope)
        else:
            model = loader.load(spec.path, spec.rope)
        conn.send(("progress", 90))
        # Built once here, so a constrained lane's first tick does not pay for it.
        constrainer = VocabConstrainer(spec.path, logit_rows(model), spec.eog)
        refused = kv_cells.probe(model, spec.kv_bits)
        if refused:
            conn.send(("error", refused))
            return
        shape = pool.model_shape(model, pool.cache_type(model), spec.kv_bits)
        layout = pool.layout(shape, spec.max_lanes, spec.max_context, pool.device_free(),
                             pool_cells=spec.pool_cells, fraction=spec.shared_pool_fraction)
        conn.send(("progress", 100))
    except Exception as exc:  # noqa: BLE001  reported to the daemon, which fails the model
        conn.send(("error", f"cannot load {spec.path} with MLX: {exc}"))
        return
    runner = MlxRunner(model, set(spec.eog), stop_flag, layout.n_ctx, spec.step_tokens, constrainer=constrainer,
                       encoder=encoder, shared_pool=layout.unified, image_encoding=spec.image_encoding,
                       kv_bits=spec.kv_bits)
    info = {"pid": os.getpid(), "n_ctx": layout.n_ctx, "n_seq_max": layout.n_seq, "kv_unified": layout.unified,
            "bytes_per_cell": layout.bytes_per_cell, "kv_bytes": layout.n_ctx * layout.bytes_per_cell,
            "kv_pool": {**layout.describe(), "shape": shape.describe(), "allocated": "as slots grow"},
            "kv_line": layout.line() + (f", {spec.kv_bits}-bit" if spec.kv_bits else "") + ", allocated as slots grow",
            "device": str(mx.default_device()), "mlx": mx.__version__}
    if encoder is not None:
        from importlib.metadata import version

        info["mlx_vlm"] = version("mlx-vlm")  # the vision half's runtime, for /health
    conn.send(("ready", info))
    serve_ticks(conn, runner)
