"""The llama.cpp engine adapter as the daemon sees it: tokenizer here, ticks in a worker process."""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
from typing import Callable

import psutil

from superfluid.core.engine import Engine, EngineCapabilities
from superfluid.core.errors import ConfigError, EngineCrashed, EngineFailure
from superfluid.core.tick import TickPlan, TickResult

from . import worker
from .vocab import Vocab

log = logging.getLogger("superfluid.llamacpp")

DEFAULT_MAX_CONTEXT = 8192


class WorkerDied(EngineCrashed):
    """The worker process exited while a tick was in flight."""


class LlamaCppEngine(Engine):
    def __init__(self, *, model, config):
        self.model_config = model
        self.path = model.path
        if not os.path.isfile(self.path):
            raise ConfigError(f"model {model.name!r}: file not found: {self.path}")
        self.vocab = Vocab(self.path, model.name)
        self.info = self.vocab.info
        train = self.info.n_ctx_train or DEFAULT_MAX_CONTEXT
        requested = model["max-context"]
        if requested and requested > train:
            raise ConfigError(f"model {model.name!r}: max-context {requested} exceeds the model's "
                              f"training context {train}")
        self.max_context = requested or min(train, DEFAULT_MAX_CONTEXT)
        self.max_lanes = model["max-batch"]
        self.threads = model["threads"] or psutil.cpu_count(logical=False) or os.cpu_count() or 1
        self.capabilities = EngineCapabilities(
            max_lanes=self.max_lanes, context_length=self.max_context, stops_mid_tick=True,
            uniform_decode_rounds=True, supports_parking=True, persists_kv=True, prefill_step_tokens=512,
            aborts_mid_step=True,
            prefix_cache=not self.vocab.shared_pool,
            tick_target_free_ms=50.0, tick_target_busy_cap_ms=250.0)
        self._mp = mp.get_context("spawn")
        # The stop flag: byte 0 is the flag, byte 1 stays 0 (the worker's abort check reads it as
        # a C string, see worker.abort_on_flag).
        self._stop = self._mp.RawArray("b", 2)
        self._proc = None
        self._conn = None
        self.worker_info: dict = {}
        self.restarts = 0
        self.state = "stopped"

    # ---- tokenizer (daemon side) ----------------------------------------------------------

    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = True) -> list[int]:
        return self.vocab.tokenize(text, add_special, parse_special)

    def token_bytes(self, token: int) -> bytes:
        return self.vocab.token_bytes(token)

    # ---- worker lifecycle -----------------------------------------------------------------

    def start(self, progress: Callable[[str], None] | None = None) -> None:
        spec = worker.WorkerSpec(path=self.path, max_lanes=self.max_lanes,
                                 max_context=self.max_context, threads=self.threads)
        parent, child = self._mp.Pipe()
        self.state = "starting"
        self._proc = self._mp.Process(target=worker.main, args=(child, self._stop, spec),
                                      name=f"superfluid-llamacpp-{self.info.name}", daemon=True)
        self._proc.start()
        child.close()
        self._conn = parent
        while True:
            if not parent.poll(1.0):
                if not self._proc.is_alive():
                    self.state = "failed"
                    raise EngineFailure(f"model {self.info.name!r}: worker exited while loading "
                                        f"(exit code {self._proc.exitcode})")
                continue
            try:
                kind, payload = parent.recv()
            except EOFError:
                self.state = "failed"
                raise EngineFailure(f"model {self.info.name!r}: worker exited while loading") from None
            if kind == "progress" and progress:
                progress(f"loading {self.info.name}: {payload}%")
            elif kind == "error":
                self.state = "failed"
                raise EngineFailure(f"model {self.info.name!r}: {payload}")
            elif kind == "ready":
                self.worker_info = payload
                self.state = "ready"
                log.info("model %s: worker pid %s ready (%s cells, %s sequences, %s KV)",
                         self.info.name, payload["pid"], payload["n_ctx"], payload["n_seq_max"],
                         "shared pool" if payload["kv_unified"] else "per-sequence buffers")
                return

    def restart(self, progress: Callable[[str], None] | None = None) -> None:
        """Start a fresh worker (after a crash); every slot's KV is gone."""
        self._kill()
        self.restarts += 1
        self.start(progress)

    def close(self) -> None:
        if self._conn is not None:
            try:
                self._conn.send(("close",))
            except (OSError, BrokenPipeError):
                pass
        if self._proc is not None:
            self._proc.join(5)
        self._kill()
        self.vocab.close()
        self.state = "stopped"

    def _kill(self) -> None:
        if self._proc is not None and self._proc.is_alive():
            self._proc.kill()
            self._proc.join(5)
        if self._conn is not None:
            self._conn.close()
        self._proc = None
        self._conn = None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def describe(self) -> dict:
        return {"engine": "llamacpp", "worker_pid": self.pid, "state": self.state,
                "restarts": self.restarts, **{k: v for k, v in self.worker_info.items() if k != "pid"}}

    # ---- ticks ----------------------------------------------------------------------------

    def request_stop(self) -> None:
        self._stop[0] = 1

    def clear_stop(self) -> None:
        self._stop[0] = 0

    def run_tick(self, plan: TickPlan) -> TickResult:
        conn = self._conn
        if conn is None:
            raise WorkerDied(f"model {self.info.name!r}: no worker running")
        try:
            conn.send(("tick", plan))
            while not conn.poll(0.5):
                if not self._proc.is_alive():
                    raise WorkerDied(f"model {self.info.name!r}: worker exited (code {self._proc.exitcode})")
            kind, payload = conn.recv()
        except (EOFError, OSError, BrokenPipeError) as exc:
            self.state = "dead"
            raise WorkerDied(f"model {self.info.name!r}: worker connection lost ({exc})") from None
        except WorkerDied:
            self.state = "dead"
            raise
        if kind != "ok":
            raise EngineFailure(f"model {self.info.name!r}: {payload}")
        return payload
