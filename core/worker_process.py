"""An engine's runtime in a supervised process of its own, driven tick by tick over a pipe.

Running the runtime in its own process means a crash or a kill takes only the worker: the daemon
sees the pipe close, raises ``EngineCrashed``, restarts it, and the lanes resume from their
tokens. Nothing here knows an engine: the llama.cpp and MLX plugins both use it, each with its
own worker entry point and spec.

The protocol: the worker is spawned as ``target(conn, stop_flag, spec)``; while loading it sends
``("progress", pct)`` and then ``("ready", info)`` or ``("error", text)``; afterwards every
``("tick", plan)`` gets ``("ok", result)`` or ``("error", WorkerError)`` (a typed value the daemon
raises again as the error it was, see ``core.worker_errors``), and ``("close",)`` ends it."""

from __future__ import annotations

import logging
import multiprocessing as mp
import signal
from typing import Any, Callable

from . import lifeline
from .errors import EngineCrashed, EngineFailure
from .stop_flag import StopFlag
from .vocab_engine import VocabEngine
from .worker_errors import WorkerError

log = logging.getLogger("superfluid.worker")


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
        self.stop_flag = StopFlag(self._mp)  # in shared memory: every worker it spawns reads it
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

    def call(self, msg: tuple) -> Any:
        """Send ``msg`` and return the worker's ``("ok", result)`` result. A worker's error is
        raised again as the error it was (its class, status and code: ``WorkerError.rebuild``),
        its traceback logged; a dead worker or pipe is WorkerDied (an EngineCrashed: restartable)."""
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
            log.error("model %s: the %s's tick raised %s\n%s", self.model, self.label, payload.kind,
                      payload.traceback.rstrip())
            raise payload.rebuild(self.model)
        return payload


class WorkerEngine(VocabEngine):
    """A vocabulary-owning engine whose ticks run in a supervised worker process: the Engine
    methods that drive its WorkerProcess. A subclass calls ``_take_vocab``, sets ``self.worker``
    and implements ``start`` (its spec and its ready log line); ``engine_name`` names it in
    /health. The stop flag is the worker's, in shared memory."""

    engine_name = "worker"
    worker: WorkerProcess

    @property
    def stop_flag(self) -> StopFlag:
        return self.worker.stop_flag

    def restart(self, progress: Callable[[str], None] | None = None) -> None:
        """Start a fresh worker (after a crash); every slot's KV is gone."""
        self.worker.kill()
        self.worker.restarts += 1
        self.start(progress)

    def close(self) -> None:
        self.worker.close()
        super().close()

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

    def run_tick(self, plan):
        return self.worker.call(("tick", plan))


WRITER_FLUSH_S = 30.0


def serve_ticks(conn, runner) -> None:
    """The worker side of the protocol once ready: run each tick with ``runner.run(plan)`` until
    ``("close",)`` or the daemon's end of the pipe closes. A failing tick is reported (its error
    as a :class:`~superfluid.core.worker_errors.WorkerError`), not fatal."""
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            break
        if msg[0] == "tick":
            try:
                conn.send(("ok", runner.run(msg[1])))
            except Exception as exc:
                conn.send(("error", WorkerError.of(exc)))
        elif msg[0] == "close":
            break
    writer = getattr(runner, "writer", None)
    if writer is not None:  # park artifacts asked for before the close land
        writer.flush(timeout=WRITER_FLUSH_S)

