"""The llama.cpp engine adapter as the daemon sees it: tokenizer here, ticks in a worker process."""

from __future__ import annotations

import logging
import os
from typing import Callable

import psutil

from superfluid.core.engine import EngineCapabilities
from superfluid.core.errors import ConfigError
from superfluid.core.worker_process import WorkerEngine, WorkerProcess

from . import FLASH_ATTN, worker
from superfluid.plugins.vocab.gguf import Vocab

log = logging.getLogger("superfluid.llamacpp")

DEFAULT_MAX_CONTEXT = 8192


class LlamaCppEngine(WorkerEngine):
    engine_name = "llamacpp"

    def __init__(self, *, model, config):
        self.model_config = model
        self.path = model.path
        if not os.path.isfile(self.path):
            raise ConfigError(f"model {model.name!r}: file not found: {self.path}")
        self._take_vocab(model, Vocab(self.path, model.name), DEFAULT_MAX_CONTEXT)
        self.threads = model["threads"] or psutil.cpu_count(logical=False) or os.cpu_count() or 1
        self.kv_unified = bool(model.values.get("kv-unified", False))
        self.pool_cells = int(model.values.get("kv-pool-cells", 0) or 0)
        self.flash_attn = FLASH_ATTN[model.values.get("flash-attn", "auto") or "auto"]
        if self.pool_cells and self.pool_cells < self.max_context:
            raise ConfigError(f"model {model.name!r}: kv-pool-cells {self.pool_cells} is below max-context "
                              f"{self.max_context} (one lane must fit)")
        self.capabilities = EngineCapabilities(
            max_lanes=self.max_lanes, context_length=self.max_context, stops_mid_tick=True,
            uniform_decode_rounds=True, supports_parking=True, persists_kv=True, prefill_step_tokens=512,
            aborts_mid_step=True, grammars=True, compact_slots=True, logprobs=True, logit_bias=True,
            embeddings=True, generates=not model["embedding-only"],
            prefix_cache=not self.vocab.recurrent,
            tick_target_free_ms=50.0, tick_target_busy_cap_ms=250.0)
        self.worker = WorkerProcess(model.name)

    def start(self, progress: Callable[[str], None] | None = None) -> None:
        spec = worker.WorkerSpec(path=self.path, max_lanes=self.max_lanes,
                                 max_context=self.max_context, threads=self.threads,
                                 kv_unified=self.kv_unified, pool_cells=self.pool_cells,
                                 flash_attn=self.flash_attn)
        info = self.worker.start(worker.main, spec, progress, name=f"superfluid-llamacpp-{self.info.name}")
        log.info("model %s: worker pid %s ready (%s cells, %s sequences, %s KV)",
                 self.info.name, info["pid"], info["n_ctx"], info["n_seq_max"],
                 "shared pool" if info["kv_unified"] else "per-sequence buffers")
