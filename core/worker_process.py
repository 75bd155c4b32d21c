"""An engine's runtime in a supervised process of its own, driven tick by tick over a pipe.

Running the runtime in its own process means a crash or a kill takes only the worker: the daemon
sees the pipe close, raises ``EngineCrashed``, restarts it, and the lanes resume from their
tokens. Nothing here knows an engine: the llama.cpp and MLX plugins both use it, each with its
own worker entry point and spec.

The protocol: the worker is spawned as ``target(conn, stop_flag, spec)``; while loading it sends
``("progress", pct)`` and then ``("ready", info)`` or ``("error", text)``; afterwards every
``("tick", plan)`` gets ``("ok", result)`` or ``("error", text)``, and ``("close",)`` ends it."""

from __future__ import annotations

import multiprocessing as mp
import signal
import traceback
from typing import Any, Callable

from . import lifeline
from .engine import Engine
from .errors import ConfigError, EngineCrashed, EngineFailure


STOP, YIELD = 0, 2  # the stop flag's bytes: stop now (even mid-step), end after the step in flight


def stop_requested(stop_flag) -> bool:
    """Whether the tick should end before its next step (a runner asks between steps)."""
    return bool(stop_flag[STOP] or stop_flag[YIELD])


class WorkerDied(EngineCrashed):
    """The worker process exited while a tick was in flight."""


class WorkerExited(EngineFailure):
    """The worker process exited before it reported ready (loading or warming up). ``exitcode``
    is the process's: negative when a signal ended it, as ``multiprocessing`` reports it."""

    def __init__(self, message: str, exitcode: int | None):
        super().__init__(message)
        self.exitcode = exitcode

    @property
    def signal(self) -> signal.Signals | None:
        """The signal that ended the worker, if one did."""
        return signal_of(self.exitcode)


def signal_of(exitcode: int | None) -> signal.Signals | None:
    """The signal behind a ``multiprocessing`` exit code (negative: killed by that signal)."""
    if exitcode is None or exitcode >= 0:
        return None
    try:
        return signal.Signals(-exitcode)
    except ValueError:
        return None


def exit_text(exitcode: int | None) -> str:
    """An exit code as a person reads it: ``exit code -11 (SIGSEGV)``."""
    sig = signal_of(exitcode)
    return f"exit code {exitcode}" + (f" ({sig.name})" if sig else "")


def _run_worker(target: Callable, conn, stop_flag, spec) -> None:
    """The spawned process's entry: watch the daemon (a SIGKILLed daemon leaves no worker behind
    holding its model), then run the engine's worker."""
    lifeline.watch_parent()
    target(conn, stop_flag, spec)


class WorkerProcess:
    """One worker process at a time for a model: spawn, wait until ready, call, kill, restart."""

    def __init__(self, model: str, label: str = "worker"):
        self.model = model   # the model's name, for messages
        self.label = label   # how messages name the process ("worker", "MLX worker")
        self._mp = mp.get_context("spawn")  # no fork: the daemon's threads and runtimes stay out
        # The stop flag: byte 0 is the flag, byte 1 stays 0, so a worker may hand it to C code
        # that reads it as a string (llama.cpp's abort callback, see llamacpp.worker.abort_on_flag).
        # Byte 2 is the yield flag, which only the step loop reads (see ``stop_requested``).
        self.stop_flag = self._mp.RawArray("b", 3)
        self._proc = None
        self._conn = None
        self.info: dict = {}
        self.restarts = 0
        self.state = "stopped"
        self.last_exitcode: int | None = None  # how the previous process ended (None: unknown)

    # ---- lifecycle ------------------------------------------------------------------------

    def start(self, target: Callable, spec: Any, progress: Callable[[str], None] | None = None,
              *, name: str) -> dict:
        """Spawn ``target(conn, stop_flag, spec)`` and wait for it to report ready; its info."""
        self.spawn(target, spec, name=name)
        return self.wait_ready(progress)

    def spawn(self, target: Callable, spec: Any, *, name: str) -> None:
        parent, child = self._mp.Pipe()
        self.state = "starting"
        self._proc = self._mp.Process(target=_run_worker, args=(target, child, self.stop_flag, spec),
                                      name=name, daemon=True)
        self._proc.start()
        child.close()
        self._conn = parent

    def wait_ready(self, progress: Callable[[str], None] | None = None) -> dict:
        """Relay loading progress until the worker is ready; EngineFailure if it fails or exits."""
        conn = self._conn
        while True:
            if not conn.poll(1.0):
                if not self._proc.is_alive():
                    raise self._exited()
                continue
            try:
                kind, payload = conn.recv()
            except EOFError:
                self._proc.join(5.0)  # a dying worker closes the pipe a moment before it is reaped
                raise self._exited() from None
            if kind == "progress" and progress:
                progress(f"loading {self.model}: {payload}%")
            elif kind == "error":
                self.state = "failed"
                self.kill()
                raise EngineFailure(f"model {self.model!r}: {payload}")
            elif kind == "ready":
                self.info = payload
                self.state = "ready"
                return payload

    def _exited(self) -> WorkerExited:
        self.state = "failed"
        code = self._proc.exitcode
        self.last_exitcode = code
        self.kill()
        return WorkerExited(f"model {self.model!r}: {self.label} exited while loading ({exit_text(code)})",
                            code)

    def close(self) -> None:
        """Ask the worker to exit, give it 5 s, then kill it."""
        if self._conn is not None:
            try:
                self._conn.send(("close",))
            except (OSError, BrokenPipeError):
                pass
        if self._proc is not None:
            self._proc.join(5)
        self.kill()
        self.state = "stopped"

    def kill(self) -> None:
        if self._proc is not None and self._proc.is_alive():
            self._proc.kill()
            self._proc.join(5)
            self.last_exitcode = None  # ended by us, not by itself
        elif self._proc is not None and self._proc.exitcode is not None:
            self.last_exitcode = self._proc.exitcode  # it ended on its own: keep how
        if self._conn is not None:
            self._conn.close()
        self._proc = None
        self._conn = None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    # ---- ticks ----------------------------------------------------------------------------

    def request_stop(self) -> None:
        self.stop_flag[STOP] = 1

    def request_yield(self) -> None:
        self.stop_flag[YIELD] = 1

    def clear_stop(self) -> None:
        self.stop_flag[STOP] = 0
        self.stop_flag[YIELD] = 0

    def call(self, msg: tuple) -> Any:
        """Send ``msg`` and return the worker's ``("ok", result)`` result. A worker error is an
        EngineFailure; a dead worker or pipe is WorkerDied (an EngineCrashed: restartable)."""
        conn = self._conn
        if conn is None:
            raise WorkerDied(f"model {self.model!r}: no {self.label} running")
        try:
            conn.send(msg)
            # A blocking read, not a poll loop: the worker holds the only other end of the pipe, so
            # its death (even SIGKILL) ends the read with EOFError; a poll and its selector would
            # add two system calls to every tick.
            kind, payload = conn.recv()
        except (EOFError, OSError, BrokenPipeError) as exc:
            self.state = "dead"
            if self._proc is not None:
                self._proc.join(1.0)  # a dying worker closes the pipe a moment before it is reaped
            code = self._proc.exitcode if self._proc is not None else None
            raise WorkerDied(f"model {self.model!r}: {self.label} connection lost "
                             f"({exc or type(exc).__name__}; {exit_text(code)})") from None
        if kind != "ok":
            raise EngineFailure(f"model {self.model!r}: {payload}")
        return payload


class WorkerEngine(Engine):
    """The Engine methods that only drive a WorkerProcess or the daemon-side tokenizer, shared by
    the engines that tokenize in the daemon and run ticks in a worker. A subclass sets
    ``self.worker`` and ``self.vocab`` and implements ``start`` (its spec and its ready log
    line); ``engine_name`` names it in /health."""

    engine_name = "worker"
    worker: WorkerProcess

    def _take_vocab(self, model, vocab, default_max_context: int) -> None:
        """Keep the daemon-side vocab and settle the model's context and lanes from its options:
        max-context may not exceed the training context (unknown: ``default_max_context``) and
        defaults to the smaller of the two."""
        self.vocab = vocab
        self.info = vocab.info
        train = self.info.n_ctx_train or default_max_context
        requested = model["max-context"]
        if requested and requested > train:
            raise ConfigError(f"model {model.name!r}: max-context {requested} exceeds the model's "
                              f"training context {train}")
        self.max_context = requested or min(train, default_max_context)
        self.max_lanes = model["max-batch"]

    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = True) -> list[int]:
        return self.vocab.tokenize(text, add_special, parse_special)

    def token_bytes(self, token: int) -> bytes:
        return self.vocab.token_bytes(token)

    def restart(self, progress: Callable[[str], None] | None = None) -> None:
        """Start a fresh worker (after a crash); every slot's KV is gone."""
        self.worker.kill()
        self.worker.restarts += 1
        self.start(progress)

    def close(self) -> None:
        self.worker.close()
        self.vocab.close()

    @property
    def pid(self) -> int | None:
        return self.worker.pid

    @property
    def state(self) -> str:
        return self.worker.state

    @property
    def restarts(self) -> int:
        return self.worker.restarts

    @property
    def worker_info(self) -> dict:
        return self.worker.info

    def describe(self) -> dict:
        return {"engine": self.engine_name, "worker_pid": self.pid, "state": self.state,
                "restarts": self.restarts, **{k: v for k, v in self.worker_info.items() if k != "pid"}}

    def request_stop(self) -> None:
        self.worker.request_stop()

    def request_yield(self) -> None:
        self.worker.request_yield()

    def clear_stop(self) -> None:
        self.worker.clear_stop()

    def run_tick(self, plan):
        return self.worker.call(("tick", plan))


def serve_ticks(conn, runner) -> None:
    """The worker side of the protocol once ready: run each tick with ``runner.run(plan)`` until
    ``("close",)`` or the daemon's end of the pipe closes. A failing tick is reported, not fatal."""
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            break
        if msg[0] == "tick":
            try:
                conn.send(("ok", runner.run(msg[1])))
            except Exception:
                conn.send(("error", traceback.format_exc()))
        elif msg[0] == "close":
            break

