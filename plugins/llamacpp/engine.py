"""The llama.cpp engine adapter as the daemon sees it: tokenizer here, ticks in a worker process."""

from __future__ import annotations

import logging
import os
import signal
from typing import Callable

import attrs
import psutil

from superfluid.core.config import CORE_OPTIONS
from superfluid.core.engine import EngineCapabilities
from superfluid.core.errors import ConfigError, EngineFailure
from superfluid.core.worker_process import WorkerEngine, WorkerExited, WorkerProcess, signal_of

from superfluid.core.media import find_mmproj

from . import extra_buffers, rank, vision, worker
from .context_params import context_settings, describe_context
from .options import FLASH_ATTN, OPTIONS
from superfluid.plugins.vocab.gguf import Vocab

log = logging.getLogger("superfluid.llamacpp")

DEFAULT_MAX_CONTEXT = 8192


class LlamaCppEngine(WorkerEngine):
    engine_name = "llamacpp"
    implements_rope_scaling = True  # rope/YaRN options reach llama_context_params (context_params.py)

    def __init__(self, *, model, config):
        self.model_config = model
        self.path = model.path
        if not os.path.isfile(self.path):
            raise ConfigError(f"model {model.name!r}: file not found: {self.path}")
        # KV types and rope settings first: a refusal (kv-bits with flash attention off) holds nothing
        self.context, self.flash_attn = context_settings(
            CORE_OPTIONS.of(model), FLASH_ATTN[OPTIONS.of(model).flash_attn or "auto"], model.name)
        self._take_vocab(model, Vocab(self.path, model.name), DEFAULT_MAX_CONTEXT)
        core, own = CORE_OPTIONS.of(model), OPTIONS.of(model)
        self.threads = core.threads or psutil.cpu_count(logical=False) or os.cpu_count() or 1
        self.kv_unified = bool(own.kv_unified)
        self.pool_cells = int(core.kv_pool_cells or 0)
        self.extra_buffers_mode = own.llama_extra_buffers or "auto"
        self.extra_buffers: extra_buffers.ExtraBuffers | None = None  # decided at the first start
        if self.pool_cells and self.pool_cells < self.max_context:
            raise ConfigError(f"model {model.name!r}: kv-pool-cells {self.pool_cells} is below max-context "
                              f"{self.max_context} (one lane must fit)")
        self.capabilities = EngineCapabilities(
            max_lanes=self.max_lanes, context_length=self.max_context, stops_mid_tick=True,
            uniform_decode_rounds=True, supports_parking=True, persists_kv=True, prefill_step_tokens=512,
            aborts_mid_step=True, grammars=True, compact_slots=True, logprobs=True, logit_bias=True,
            embeddings=True, generates=not core.embedding_only,
            prefix_cache=not self.vocab.recurrent, adapters="per_tick",  # one LoRA set a context (lora.py)
            tick_target_free_ms=50.0, tick_target_busy_cap_ms=250.0)
        # a reranker GGUF (rank pooling): how its pairs become prompts, for /v1/rerank (rank.py)
        self.info = attrs.evolve(self.info, rerank=rank.rerank_format(self.vocab, model.name))
        self.mmproj = self._vision(model, core.mmproj)
        self.image_encoding = core.image_encoding or "admission"
        self.worker = WorkerProcess(model.name)

    def _vision(self, model, configured: str | None) -> str | None:
        """The mmproj that makes this model take images (set, or found beside the GGUF), with the
        layout it gives an image; None for a text-only model."""
        try:
            mmproj = find_mmproj(self.path, configured)
        except OSError as exc:
            raise ConfigError(f"model {model.name!r}: {exc}") from None
        if mmproj is None:
            return None

        def token_id(text: str) -> int | None:
            ids = self.vocab.tokenize(text, add_special=False, parse_special=True)
            return ids[0] if len(ids) == 1 else None

        try:
            layout = vision.vision_info(model.name, mmproj, token_id)
        except ValueError as exc:
            raise ConfigError(f"model {model.name!r}: {exc}") from None
        self.info = attrs.evolve(self.info, vision=layout)
        self.capabilities = attrs.evolve(self.capabilities, vision=True)
        log.info("model %s: takes images through %s (%s: %s)", model.name, mmproj, layout.family,
                 f"{layout.rows} rows an image, {layout.tile} px tiles" if layout.smart_resize is None else
                 f"one row a {layout.tile} px merged patch, M-RoPE positions")
        return mmproj

    def start(self, progress: Callable[[str], None] | None = None) -> None:
        """Start the worker under the extra-buffer decision; if it dies from a signal before it is
        ready (its warm-up decode is the shape AMX faulted on), start it once more with the
        extra buffer types off. A fallback sticks: restarts after a crash stay on safe settings."""
        if self.extra_buffers is None:
            self.extra_buffers = extra_buffers.choose(self.extra_buffers_mode)
            log.info("model %s: llama.cpp extra buffer types %s (%s)", self.info.name,
                     "on" if self.extra_buffers.use else "off", self.extra_buffers.reason)
        try:
            info = self._start_worker(progress)
        except WorkerExited as exc:
            if exc.signal is None:
                raise
            if not self.extra_buffers.use:
                raise self._safe_settings_died(exc) from None
            self._fall_back(exc.signal.name, "before it was ready (loading or its warm-up decode)")
            try:
                info = self._start_worker(progress)
            except WorkerExited as again:
                if again.signal is None:
                    raise
                raise self._safe_settings_died(again) from None
        self._declare_layout(info)
        log.info("model %s: worker pid %s ready (%s; %s; weights in %s)", self.info.name, info["pid"],
                 info.get("kv_line") or f"{info['n_ctx']} cells, {info['n_seq_max']} sequences",
                 describe_context(self.context),
                 ", ".join(f"{k} {v:g} MiB" for k, v in info.get("weight_buffers", {}).items()) or "?")
        if info.get("kv_bytes_logged") and info.get("kv_bytes_computed") != info.get("kv_bytes"):
            log.warning("model %s: llama.cpp allocated %.2f MiB of KV, where the model's declared shape gives "
                        "%.2f MiB; the pool is reported at llama.cpp's figure (an architecture plugins/kvpool "
                        "does not model)", self.info.name, info["kv_bytes_logged"] / 2**20,
                        info["kv_bytes_computed"] / 2**20)

    def _declare_layout(self, info: dict) -> None:
        """What the worker's KV layout means for the scheduler. Its sequences beyond the lanes are
        spare slots, where finished lanes' prefixes wait (the most recent ones stay in the pool).
        In per-sequence buffers each costs a buffer of max-context cells; in a shared pool a spare
        sequence costs no cells (only a sliding-window model's window buffer grows with the
        sequences), and it still lets that many more cached prefixes stay while every lane runs,
        within the one lane's context the KV manager keeps of cached prefixes there. The KV bytes
        allocated are reported on /health (``kv_bytes``) and in the ready line."""
        info.setdefault("kv_bytes", info["n_ctx"] * info.get("bytes_per_cell", 0))
        self.capabilities = attrs.evolve(self.capabilities, spare_slots=max(0, info["n_seq_max"] - self.max_lanes),
                                         shared_pool=bool(info["kv_unified"]))

    def restart(self, progress: Callable[[str], None] | None = None) -> None:
        """After a crash: a worker that a signal (not a kill) ended while the extra buffer types
        were on comes back with them off, so a fault they cause is not met again on every restart."""
        self.worker.kill()  # reaps the dead worker, so its exit code is known (a second kill is a no-op)
        sig = signal_of(self.worker.last_exitcode)
        if sig is not None and sig not in (signal.SIGKILL, signal.SIGTERM) and self.extra_buffers \
                and self.extra_buffers.use:
            self._fall_back(sig.name, "while serving")
        super().restart(progress)

    def _start_worker(self, progress: Callable[[str], None] | None) -> dict:
        spec = worker.WorkerSpec(path=self.path, max_lanes=self.max_lanes,
                                 max_context=self.max_context, threads=self.threads,
                                 kv_unified=self.kv_unified, pool_cells=self.pool_cells,
                                 flash_attn=self.flash_attn, extra_buffers=self.extra_buffers.use,
                                 mmproj=self.mmproj, image_rows=self.info.vision.rows if self.info.vision else 0,
                                 image_encoding=self.image_encoding, context=self.context)
        info = self.worker.start(worker.main, spec, progress, name=f"superfluid-llamacpp-{self.info.name}")
        info["extra_buffers"] = self.extra_buffers.describe()
        info["cpu_features"] = self.extra_buffers.features
        return info

    def _fall_back(self, signal_name: str, when: str) -> None:
        report = self.extra_buffers.report.strip()
        log.warning("model %s: the llama.cpp worker died with %s %s with extra buffer types on (%s); "
                    "starting it again with them off. llama.cpp's CPU report: %s. Set %s off (TOML "
                    "llama-extra-buffers = \"off\") to start that way.", self.info.name, signal_name, when,
                    self.extra_buffers.reason, report, extra_buffers.FLAG)
        self.extra_buffers = self.extra_buffers.turned_off(
            f"fallback: the worker died with {signal_name} {when} with them on")

    def _safe_settings_died(self, exc: WorkerExited) -> EngineFailure:
        return EngineFailure(
            f"model {self.info.name!r}: the llama.cpp worker died with {exc.signal.name} before it was ready "
            f"(loading or its warm-up decode) even with extra buffer types off ({extra_buffers.FLAG} off); llama.cpp's CPU report: "
            f"{self.extra_buffers.report.strip()}")
