"""The llama.cpp worker process: loads the model and runs ticks sent over a pipe.

Running the runtime in a process of its own means a crash or a kill takes only the worker: the
daemon sees the pipe close, restarts it, and the lanes resume from their tokens."""

from __future__ import annotations

import os

import attrs

from superfluid.core.stop_flag import StopFlag
from superfluid.core.worker_process import serve_ticks


@attrs.define(frozen=True)
class WorkerSpec:
    """Everything the worker needs to build its context (decided in the daemon)."""

    path: str
    max_lanes: int
    max_context: int
    threads: int
    n_batch: int = 2048
    n_ubatch: int = 512
    shared_pool_fraction: float = 0.6
    kv_unified: bool = False  # one shared pool whatever the model (--kv-unified)
    pool_cells: int = 0       # the shared pool's size (--kv-pool-cells; 0: lanes × context, capped)
    flash_attn: int = -1      # llama_flash_attn_type: -1 auto, 0 off, 1 on (--flash-attn)
    native_rounds: bool = True  # decode rounds in C where the extension is built (False: Python)
    extra_buffers: bool = True  # weights in llama.cpp's extra buffer types (decided in extra_buffers.py)
    mmproj: str | None = None   # the vision half: images are encoded in this worker (vision.py)
    image_rows: int = 0         # embedding rows an image fills (the daemon's layout)


def layout(n_lanes: int, max_context: int, shared_pool: bool, bytes_per_cell: int,
           free_bytes: int, fraction: float, pool_cells: int = 0) -> tuple[int, int, bool]:
    """(n_seq_max, n_ctx, kv_unified) for a context.

    Plain attention gets a KV buffer of max-context cells per sequence, lanes + 2 sequences
    (4..256), so a step attends only over its own sequence. Sliding-window and recurrent models
    (and any model with ``shared_pool`` forced, --kv-unified) share one pool: ``pool_cells`` if
    given, else lanes × max-context cells capped at ``fraction`` of free memory; never fewer
    than max-context, so one lane always fits."""
    n_seq = min(max(n_lanes + 2, 4), 256)
    if not shared_pool:
        return n_seq, n_seq * max_context, False
    cells = pool_cells or n_lanes * max_context
    if bytes_per_cell > 0 and not pool_cells:
        cells = min(cells, int(free_bytes * fraction) // bytes_per_cell)
    return n_seq, max(cells, max_context), True


def abort_on_flag(cparams, stop_flag: StopFlag) -> None:
    """Make llama.cpp abort a running ``llama_decode`` as soon as the stop flag is set.

    ggml asks the abort callback between graph nodes, hundreds of times a step, so a Python
    callback would cost milliseconds per step. libc's ``strlen`` is a C function of the right
    shape: on the stop flag's first two bytes (stop, 0) it returns 1 when the flag is set and 0 when it is
    not, read fresh from shared memory each time. An aborted step leaves the KV as it was."""
    import ctypes
    import ctypes.util

    import llama_cpp

    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    cparams.abort_callback = ctypes.cast(libc.strlen, llama_cpp.ggml_abort_callback)
    cparams.abort_callback_data = stop_flag.address


def main(conn, stop_flag: StopFlag, spec: WorkerSpec) -> None:
    """Worker entry point (spawned); the protocol is core.worker_process's."""
    import llama_cpp
    import llama_cpp._logger  # noqa: F401  routes llama.cpp's log through Python logging
    import psutil

    from .extra_buffers import model_params, weight_buffers
    from .hidden import model_pooling
    from .runner import LlamaCppRunner
    from .warmup import WarmupFailed, warm_up

    llama_cpp._logger.logger.setLevel(40)
    llama_cpp.llama_backend_init()

    last = [-1]

    @llama_cpp.llama_progress_callback
    def on_progress(progress: float, _user) -> bool:
        pct = int(progress * 100)
        if pct >= last[0] + 10 or pct == 100:
            last[0] = pct
            conn.send(("progress", pct))
        return True

    mparams = model_params(spec.extra_buffers)
    mparams.progress_callback = on_progress
    buffers: dict[str, float] = {}
    with weight_buffers(buffers):
        model = llama_cpp.llama_model_load_from_file(spec.path.encode(), mparams)
    if not model:
        conn.send(("error", f"cannot load model {spec.path}"))
        return

    shared = bool(llama_cpp.llama_model_n_swa(model) > 0 or llama_cpp.llama_model_is_recurrent(model)
                  or llama_cpp.llama_model_is_hybrid(model))
    n_layer = llama_cpp.llama_model_n_layer(model)
    n_head = max(llama_cpp.llama_model_n_head(model), 1)
    head_dim = llama_cpp.llama_model_n_embd(model) // n_head
    bytes_per_cell = 2 * n_layer * llama_cpp.llama_model_n_head_kv(model) * head_dim * 2  # K+V, f16
    n_swa = llama_cpp.llama_model_n_swa(model)
    recurrent = bool(llama_cpp.llama_model_is_recurrent(model) or llama_cpp.llama_model_is_hybrid(model))
    n_seq, n_ctx, unified = layout(spec.max_lanes, spec.max_context, shared or spec.kv_unified, bytes_per_cell,
                                   psutil.virtual_memory().available, spec.shared_pool_fraction, spec.pool_cells)

    cparams = llama_cpp.llama_context_default_params()
    cparams.n_ctx = n_ctx
    cparams.n_batch = spec.n_batch
    cparams.n_ubatch = spec.n_ubatch
    cparams.n_seq_max = n_seq
    cparams.kv_unified = unified
    cparams.n_threads = spec.threads
    cparams.n_threads_batch = spec.threads
    cparams.flash_attn_type = spec.flash_attn
    cparams.no_perf = True
    # no pooling layer of llama.cpp's: embedding lanes are prefilled in chunks like any other and
    # pooled by the runner (hidden.py), so the context needs none and generation is unaffected
    cparams.pooling_type = llama_cpp.LLAMA_POOLING_TYPE_NONE
    abort_on_flag(cparams, stop_flag)
    ctx = llama_cpp.llama_init_from_model(model, cparams)
    if not ctx:
        conn.send(("error", f"cannot create a context of {n_ctx} cells for {spec.path}"))
        return
    n_ctx_real = llama_cpp.llama_n_ctx(ctx)
    try:
        warm_up(ctx, llama_cpp.llama_model_get_vocab(model), spec.extra_buffers)
    except WarmupFailed as exc:
        conn.send(("error", str(exc)))
        return
    runner = LlamaCppRunner(model, ctx, n_seq, spec.n_ubatch, stop_flag,
                        n_ctx_real, unified=unified,  # occupancy counts every cell: spare sequences hold prefixes
                        n_swa=n_swa, recurrent=recurrent, native_rounds=spec.native_rounds,
                        pooling=model_pooling(model))
    encoder = None
    if spec.mmproj:
        from .vision import MtmdEncoder

        try:
            encoder = MtmdEncoder(spec.mmproj, model, spec.threads, spec.image_rows)
        except RuntimeError as exc:
            conn.send(("error", str(exc)))
            return
        runner.take_images(encoder)
    conn.send(("ready", {"pid": os.getpid(), "n_ctx": n_ctx_real, "n_seq_max": n_seq,
                         "kv_unified": unified, "shared_pool": shared, "n_swa": n_swa,
                         "bytes_per_cell": bytes_per_cell, "native_rounds": runner.rounds is not None,
                         "weight_buffers": buffers}))
    try:
        serve_ticks(conn, runner)
    finally:
        if encoder is not None:
            encoder.close()
        runner.close()
        llama_cpp.llama_free(ctx)
        llama_cpp.llama_model_free(model)
