"""The llama.cpp worker process: loads the model and runs ticks sent over a pipe.

Running the runtime in a process of its own means a crash or a kill takes only the worker: the
daemon sees the pipe close, restarts it, and the lanes resume from their tokens."""

from __future__ import annotations

import os

import attrs

from superfluid.core.stop_flag import StopFlag
from superfluid.core.worker_process import serve_ticks

from .context_params import ContextSettings


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
    image_encoding: str = "admission"  # encode on a background thread ("tick": on the tick thread)
    context: ContextSettings = ContextSettings()  # KV cache types, rope/YaRN (context_params.py)


# Window layers hold every cell (llama_context_default_params' default, kept on purpose): with it off
# they would hold only window × sequences + n_ubatch cells, shared by every sequence, so a finished
# conversation's window would be overwritten as soon as others run, and its prefix could no longer
# seed a lane (LlamaCppRunner.keep_prefix). kvpool.shape sizes either case.
SWA_FULL = True


def size_pool(model, spec: WorkerSpec, n_gpu_layers: int, buffers: dict[str, float]):
    """(layout, KV shape, v_trans) for a loaded model: the layout is kvpool.layout's decision,
    bytes per cell from the model's declared key and value lengths, the cap from the memory the
    weights leave free where they sit (after loading)."""
    import llama_cpp

    from superfluid.plugins.kvpool.layout import decide, sequences

    from .device_memory import ggml_devices, weights_free
    from .kv_shape import model_kv_shape

    shape = model_kv_shape(model, spec.context.type_k, spec.context.type_v)
    shared = bool(llama_cpp.llama_model_n_swa(model) > 0 or llama_cpp.llama_model_is_recurrent(model)
                  or llama_cpp.llama_model_is_hybrid(model))
    v_trans = spec.flash_attn != 1  # without flash attention V is stored transposed (padded to the widest)
    memory = weights_free(n_gpu_layers, int(buffers.get("CPU_Mapped", 0.0) * 2**20), ggml_devices())
    n_seq = sequences(spec.max_lanes)
    pool = decide(spec.max_lanes, spec.max_context, shared or spec.kv_unified, shape.bytes_per_cell(v_trans),
                  memory, spec.shared_pool_fraction, spec.pool_cells,
                  cells_within=lambda budget: shape.cells_within(budget, n_seq, swa_full=SWA_FULL,
                                                                 n_ubatch=spec.n_ubatch, v_trans=v_trans))
    return pool, shape, v_trans


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

    from .context_params import apply as apply_context_settings
    from .extra_buffers import model_params, weight_buffers
    from .kv_log import kv_allocated, kv_caches
    from .hidden import model_pooling
    from .rank import RankHead
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

    n_swa = llama_cpp.llama_model_n_swa(model)
    recurrent = bool(llama_cpp.llama_model_is_recurrent(model) or llama_cpp.llama_model_is_hybrid(model))
    pool, shape, v_trans = size_pool(model, spec, mparams.n_gpu_layers, buffers)
    n_seq, unified = pool.n_seq, pool.unified

    cparams = llama_cpp.llama_context_default_params()
    cparams.n_ctx = pool.n_ctx
    cparams.swa_full = SWA_FULL
    cparams.n_batch = spec.n_batch
    cparams.n_ubatch = spec.n_ubatch
    cparams.n_seq_max = n_seq
    cparams.kv_unified = unified
    cparams.n_threads = spec.threads
    cparams.n_threads_batch = spec.threads
    cparams.flash_attn_type = spec.flash_attn
    apply_context_settings(cparams, spec.context)
    cparams.no_perf = True
    # no pooling layer of llama.cpp's: embedding lanes are prefilled in chunks like any other and
    # pooled by the runner (hidden.py), so the context needs none and generation is unaffected
    cparams.pooling_type = llama_cpp.LLAMA_POOLING_TYPE_NONE
    abort_on_flag(cparams, stop_flag)
    caches: list = []
    with kv_caches(caches):
        ctx = llama_cpp.llama_init_from_model(model, cparams)
    if not ctx:
        conn.send(("error", f"cannot create a context of {pool.n_ctx} cells for {spec.path}" + (
            f" with {spec.context.type_k} KV (its head sizes must be whole blocks of 32 values)"
            if spec.context.quantized else "")))
        return
    n_ctx_real = llama_cpp.llama_n_ctx(ctx)
    kv_bytes, logged, computed = kv_allocated(shape, pool, n_ctx_real, caches, spec.n_ubatch, v_trans, SWA_FULL)
    try:
        warm_up(ctx, llama_cpp.llama_model_get_vocab(model), spec.extra_buffers)
    except WarmupFailed as exc:
        conn.send(("error", str(exc)))
        return
    runner = LlamaCppRunner(model, ctx, n_seq, spec.n_ubatch, stop_flag,
                        n_ctx_real, unified=unified,  # occupancy counts every cell: spare sequences hold prefixes
                        n_swa=n_swa, recurrent=recurrent, native_rounds=spec.native_rounds,
                        pooling=model_pooling(model))
    runner.hidden.head = RankHead.load(spec.path, model)  # a reranker's classification head (rank.py)
    encoder = None
    if spec.mmproj:
        from .vision import MtmdEncoder

        try:
            encoder = MtmdEncoder(spec.mmproj, model, spec.threads, spec.image_rows)
        except RuntimeError as exc:
            conn.send(("error", str(exc)))
            return
        runner.take_images(encoder, spec.image_encoding)
    conn.send(("ready", {"pid": os.getpid(), "n_ctx": n_ctx_real, "n_seq_max": n_seq,
                         "kv_unified": unified, "shared_pool": bool(n_swa > 0 or recurrent), "n_swa": n_swa,
                         "bytes_per_cell": pool.bytes_per_cell, "kv_bytes": kv_bytes, "kv_bytes_logged": logged, "kv_bytes_computed": computed,
                         "kv_pool": {**pool.describe(n_ctx_real, kv_bytes), "shape": shape.describe(),
                                     "llama_caches": [c.describe() for c in caches]},
                         "kv_line": pool.line(n_ctx_real, kv_bytes),
                         "native_rounds": runner.rounds is not None, "weight_buffers": buffers}))
    try:
        serve_ticks(conn, runner)
    finally:
        runner.close()  # (its background encoder first: the mtmd context goes next)
        if encoder is not None:
            encoder.close()
        llama_cpp.llama_free(ctx)
        llama_cpp.llama_model_free(model)
