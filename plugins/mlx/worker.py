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


def kv_cells(max_lanes: int, max_context: int) -> int:
    """The pool the scheduler's pressure watermarks see: max-context cells per lane (a full
    batch of full lanes is 100 %). MLX allocates each slot's cache as it grows (256 cells at a
    time), so this is a budget."""
    return max_lanes * max_context


def logit_rows(model) -> int | None:
    """The length of the model's logits row (its ``vocab_size``; None where it does not say)."""
    return int(getattr(getattr(model, "args", None), "vocab_size", 0) or 0) or None


def main(conn, stop_flag: StopFlag, spec: WorkerSpec) -> None:
    """Worker entry point (spawned); the protocol is core.worker_process's."""
    try:
        import mlx.core as mx

        from . import loader
        from superfluid.plugins.vocab.constraints import VocabConstrainer
        from .runner import MlxRunner

        conn.send(("progress", 0))
        encoder = None
        if spec.vision:
            from . import vision

            model, encoder = vision.load(spec.path)
        else:
            model = loader.load(spec.path)
        conn.send(("progress", 90))
        # Built once here, so a constrained lane's first tick does not pay for it.
        constrainer = VocabConstrainer(spec.path, logit_rows(model), spec.eog)
        conn.send(("progress", 100))
    except Exception as exc:  # noqa: BLE001  reported to the daemon, which fails the model
        conn.send(("error", f"cannot load {spec.path} with MLX: {exc}"))
        return
    capacity = kv_cells(spec.max_lanes, spec.max_context)
    runner = MlxRunner(model, set(spec.eog), stop_flag, capacity, spec.step_tokens, constrainer=constrainer,
                       encoder=encoder)
    info = {"pid": os.getpid(), "n_ctx": capacity, "device": str(mx.default_device()), "mlx": mx.__version__}
    if encoder is not None:
        from importlib.metadata import version

        info["mlx_vlm"] = version("mlx-vlm")  # the vision half's runtime, for /health
    conn.send(("ready", info))
    serve_ticks(conn, runner)
