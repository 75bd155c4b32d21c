"""The MLX engine adapter as the daemon sees it: tokenizer here, ticks in a worker process."""

from __future__ import annotations

import importlib.util
import logging
import multiprocessing as mp
import os
from typing import Callable

import attrs

from superfluid.core.engine import Engine, EngineCapabilities
from superfluid.core.errors import ConfigError, EngineCrashed, EngineFailure
from superfluid.core.tick import TickPlan, TickResult

from . import worker
from .vocab import open_vocab

log = logging.getLogger("superfluid.mlx")

DEFAULT_MAX_CONTEXT = 8192


class WorkerDied(EngineCrashed):
    """The worker process exited while a tick was in flight."""


def _capabilities(**kw) -> EngineCapabilities:
    names = {f.name for f in attrs.fields(EngineCapabilities)}
    return EngineCapabilities(**{k: v for k, v in kw.items() if k in names})


class MlxEngine(Engine):
    def __init__(self, *, model, config):
        missing = [m for m in ("mlx", "mlx_lm") if importlib.util.find_spec(m) is None]
        if missing:  # the worker imports them; the daemon only checks they are there
            raise ConfigError(f"model {model.name!r}: engine 'mlx' needs {' and '.join(missing)} "
                              "(pip install 'superfluid[mlx]')")
        self.model_config = model
        self.path = model.path
        if not (os.path.isfile(self.path) or os.path.isdir(self.path)):
            raise ConfigError(f"model {model.name!r}: file not found: {self.path}")
        if os.path.isdir(self.path) and not os.path.isfile(os.path.join(self.path, "config.json")):
            raise ConfigError(f"model {model.name!r}: {self.path} is not an mlx-lm model directory "
                              "(no config.json)")
        self.vocab = open_vocab(self.path, model.name)
        self.info = self.vocab.info
        train = self.info.n_ctx_train or DEFAULT_MAX_CONTEXT
        requested = model["max-context"]
        if requested and requested > train:
            raise ConfigError(f"model {model.name!r}: max-context {requested} exceeds the model's "
                              f"training context {train}")
        self.max_context = requested or min(train, DEFAULT_MAX_CONTEXT)
        self.max_lanes = model["max-batch"]
        self.capabilities = _capabilities(
            max_lanes=self.max_lanes, context_length=self.max_context, stops_mid_tick=True,
            uniform_decode_rounds=True, supports_parking=True, persists_kv=True, prefix_cache=True,
            aborts_mid_step=False, prefill_step_tokens=worker.PREFILL_STEP,
            tick_target_free_ms=50.0, tick_target_busy_cap_ms=250.0)
        self._mp = mp.get_context("spawn")
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
        spec = worker.WorkerSpec(path=self.path, max_lanes=self.max_lanes, max_context=self.max_context,
                                 eog=frozenset(self.vocab.eog))
        parent, child = self._mp.Pipe()
        self.state = "starting"
        self._proc = self._mp.Process(target=worker.main, args=(child, self._stop, spec),
                                      name=f"superfluid-mlx-{self.info.name}", daemon=True)
        self._proc.start()
        child.close()
        self._conn = parent
        while True:
            if not parent.poll(1.0):
                if not self._proc.is_alive():
                    self.state = "failed"
                    raise EngineFailure(f"model {self.info.name!r}: MLX worker exited while loading "
                                        f"(exit code {self._proc.exitcode})")
                continue
            try:
                kind, payload = parent.recv()
            except EOFError:
                self.state = "failed"
                raise EngineFailure(f"model {self.info.name!r}: MLX worker exited while loading") from None
            if kind == "progress" and progress:
                progress(f"loading {self.info.name}: {payload}%")
            elif kind == "error":
                self.state = "failed"
                self._kill()
                raise EngineFailure(f"model {self.info.name!r}: {payload}")
            elif kind == "ready":
                self.worker_info = payload
                self.state = "ready"
                log.info("model %s: MLX worker pid %s ready (mlx %s on %s, %s KV cells)", self.info.name,
                         payload["pid"], payload["mlx"], payload["device"], payload["n_ctx"])
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
        return {"engine": "mlx", "worker_pid": self.pid, "state": self.state, "restarts": self.restarts,
                **{k: v for k, v in self.worker_info.items() if k != "pid"}}

    # ---- ticks ----------------------------------------------------------------------------

    def request_stop(self) -> None:
        self._stop[0] = 1

    def clear_stop(self) -> None:
        self._stop[0] = 0

    def run_tick(self, plan: TickPlan) -> TickResult:
        conn = self._conn
        if conn is None:
            raise WorkerDied(f"model {self.info.name!r}: no MLX worker running")
        try:
            conn.send(("tick", plan))
            while not conn.poll(0.5):
                if not self._proc.is_alive():
                    raise WorkerDied(f"model {self.info.name!r}: MLX worker exited (code {self._proc.exitcode})")
            kind, payload = conn.recv()
        except (EOFError, OSError, BrokenPipeError) as exc:
            self.state = "dead"
            raise WorkerDied(f"model {self.info.name!r}: MLX worker connection lost ({exc})") from None
        except WorkerDied:
            self.state = "dead"
            raise
        if kind != "ok":
            raise EngineFailure(f"model {self.info.name!r}: {payload}")
        return payload
