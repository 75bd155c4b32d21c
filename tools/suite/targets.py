"""Targets: how each server is started for a scenario, on a free loopback port, and stopped by PID.

* ``superfluid`` — ``python -m superfluid.core.cli serve`` (llama.cpp engine).
* ``superfluid-mlx`` — the same with ``--engine mlx`` (needs the ``mlx`` extra); scenarios see it
  as ``superfluid`` (:data:`FAMILY`), it is the same server on another engine.
* ``llama-server`` — llama.cpp's own server, the build of ``tools/bench/build_llama_server.sh``
  (same vendored llama.cpp as superfluid's engine).
* ``llama-cpp-python`` — ``python -m llama_cpp.server`` (needs the ``suite`` extra).
* ``mlx-lm`` — mlx-lm's own server, ``python -m mlx_lm server``, on the GGUF converted once to an
  mlx-lm directory (:mod:`tools.suite.mlx_lm_dir`); warmed with a one-token request before it
  counts as started, since it loads the model at its first request.

Every server is started with :func:`superfluid.core.lifeline.popen`, in a session of its own: it
is stopped by PID (SIGTERM, then SIGKILL of its process group), and the kernel kills it if the
tool that started it dies first, however it died.

Each scenario asks for a :class:`ServeConfig` (lanes, per-lane context, parking, a state
folder); a target maps it onto its own flags (``-np``/``-c`` for llama-server; llama-cpp-python
serves one request at a time whatever the lanes).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import json
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from superfluid.core import lifeline

from . import mlx_lm_dir

ROOT = Path(__file__).resolve().parents[2]
MODEL_NAME = "smollm2"
LLAMA_SERVER_DEFAULT = (Path(os.environ.get("SUPERFLUID_CACHE", Path.home() / ".cache/superfluid"))
                        / "llama-server-src/llama_cpp_python-0.3.36/build-llama-server/bin/llama-server")
KINDS = ("superfluid", "superfluid-mlx", "llama-server", "llama-cpp-python", "mlx-lm")
# what a scenario sees a kind as: superfluid on MLX is superfluid (sessions, /slots, workers)
FAMILY = {"superfluid-mlx": "superfluid"}
# peers with no view of their lanes and queue (no /slots, no queue metric): probed instead
NO_LANE_VIEW = ("llama-cpp-python", "mlx-lm")
# peers that do not honour ignore_eos: a long reply is kept going by biasing the end tokens away
NO_IGNORE_EOS = ("llama-cpp-python", "mlx-lm")


def family(kind: str) -> str:
    return FAMILY.get(kind, kind)


def mlx_lm_ok() -> str | None:
    """None when mlx-lm's server can start, else what is missing."""
    import importlib.util
    missing = [m for m in ("mlx", "mlx_lm") if importlib.util.find_spec(m) is None]
    return f"mlx_lm.server needs the mlx extra (pip install -e '.[mlx]'): missing {', '.join(missing)}" \
        if missing else None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def default_model() -> str:
    from superfluid.core.default_model import default_model_path
    return default_model_path()


def threads() -> int:
    try:
        import psutil
        return psutil.cpu_count(logical=False) or os.cpu_count() or 2
    except ImportError:  # pragma: no cover
        return os.cpu_count() or 2


def llama_server_binary() -> str | None:
    env = os.environ.get("LLAMA_SERVER")
    if env:
        return env
    if LLAMA_SERVER_DEFAULT.exists():
        return str(LLAMA_SERVER_DEFAULT)
    return shutil.which("llama-server")


def llama_cpp_python_server_ok() -> str | None:
    """None when ``python -m llama_cpp.server`` can start, else what is missing."""
    import importlib.util
    missing = [m for m in ("fastapi", "pydantic_settings", "sse_starlette", "starlette_context", "uvicorn")
               if importlib.util.find_spec(m) is None]
    if missing:
        return (f"llama-cpp-python's server needs the suite extra (pip install -e '.[suite]'): "
                f"missing {', '.join(missing)}")
    return None


@dataclass
class ServeConfig:
    lanes: int = 8
    context: int = 4096           # per lane
    park: bool = False
    state_dir: str | None = None  # superfluid --state-dir; llama-server --slot-save-path; llama-cpp-python disk cache
    qos: bool = True              # False: superfluid ignores the QoS header (--no-http-qos-header)
    extra: list[str] = field(default_factory=list)  # more superfluid flags


class Server:
    """One started server process (its own session, so a stop reaches every child)."""

    def __init__(self, kind: str, cmd: list[str], log_path: Path, ready_path: str, cwd: str | None = None,
                 startup_timeout: float = 180.0, env: dict[str, str] | None = None,
                 warm: Callable[[str], None] | None = None, host: str = "127.0.0.1"):
        self.kind, self.cmd, self.log_path, self.ready_path, self.cwd = kind, cmd, log_path, ready_path, cwd
        self.env, self.warm = env or {}, warm  # warm(base): run once ready, before start() returns
        self.port = int(cmd[cmd.index("--port") + 1])
        self.base = f"http://{host}:{self.port}"  # host: another address where it listens in a netns
        self.startup_timeout = startup_timeout
        self.proc: subprocess.Popen | None = None
        self._log = None
        self.start()

    def start(self) -> None:
        self._log = open(self.log_path, "ab")
        env = dict(os.environ, PYTHONUNBUFFERED="1", **self.env)
        self.proc = lifeline.popen(self.cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                     cwd=self.cwd or str(ROOT), start_new_session=True)
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.kind} exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.base + self.ready_path, timeout=2) as r:
                    ready = r.status == 200
            except OSError:
                ready = False
            if ready:
                try:
                    if self.warm is not None:
                        self.warm(self.base)
                except Exception as e:
                    self.stop()
                    raise RuntimeError(f"{self.kind} failed its warm-up request: {e}\n{self.log_tail()}") from e
                return
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"{self.kind} not ready in {self.startup_timeout}s:\n{self.log_tail()}")

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def log_tail(self, n: int = 4000) -> str:
        return self.log_text()[-n:]

    def terminate(self, timeout: float = 30.0) -> tuple[int | None, float]:
        """SIGTERM and wait: (exit code, seconds); SIGKILL of the process group past ``timeout``
        (exit code None then)."""
        t0 = time.monotonic()
        rc = None
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                rc = self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.proc.wait(10)
                rc = None
        elif self.proc is not None:
            rc = self.proc.returncode
        if self._log:
            self._log.close()
            self._log = None
        return rc, time.monotonic() - t0

    def stop(self) -> None:
        self.terminate(20.0)

    def restart(self) -> None:
        self.terminate(30.0)
        self.start()


def warm_up(base: str, timeout: float = 300.0) -> None:
    """One one-token completion, so a server that loads its model at the first request has
    loaded it before anything is measured."""
    body = json.dumps({"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 1, "temperature": 0}).encode()
    req = urllib.request.Request(base + "/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        r.read()


def start(kind: str, cfg: ServeConfig, log_path: Path, model: str) -> Server:
    port = str(free_port())
    if kind in ("superfluid", "superfluid-mlx"):
        cmd = [sys.executable, "-m", "superfluid.core.cli", "serve", "--model", model, "--model-name",
               MODEL_NAME, "--host", "127.0.0.1", "--port", port, "--max-batch", str(cfg.lanes),
               "--max-context", str(cfg.context)]
        if kind == "superfluid-mlx":
            missing = mlx_lm_ok()
            if missing:
                raise RuntimeError(missing.replace("mlx_lm.server", "superfluid's MLX engine"))
            cmd += ["--engine", "mlx"]
        if cfg.park:
            cmd.append("--park")
        if cfg.state_dir:
            cmd += ["--state-dir", cfg.state_dir]
        if not cfg.qos:
            cmd.append("--no-http-qos-header")
        cmd += cfg.extra
        return Server(kind, cmd, log_path, "/health")
    if kind == "llama-server":
        binary = llama_server_binary()
        if binary is None:
            raise RuntimeError("no llama-server: run tools/bench/build_llama_server.sh or set LLAMA_SERVER")
        t = str(threads())
        cmd = [binary, "-m", model, "--alias", MODEL_NAME, "--host", "127.0.0.1", "--port", port,
               "-np", str(cfg.lanes), "-c", str(cfg.lanes * cfg.context), "-t", t, "--metrics", "--jinja"]
        if cfg.state_dir:
            cmd += ["--slot-save-path", cfg.state_dir]
        return Server(kind, cmd, log_path, "/health")
    if kind == "llama-cpp-python":
        missing = llama_cpp_python_server_ok()
        if missing:
            raise RuntimeError(missing)
        t = str(threads())
        cmd = [sys.executable, "-m", "llama_cpp.server", "--model", model, "--model_alias", MODEL_NAME,
               "--host", "127.0.0.1", "--port", port, "--n_ctx", str(cfg.context), "--n_threads", t,
               "--n_threads_batch", t, "--verbose", "true"]
        cwd = None
        if cfg.state_dir:  # its own persistence: the disk prompt cache, in the working directory
            cmd += ["--cache", "true", "--cache_type", "disk"]
            cwd = cfg.state_dir
        return Server(kind, cmd, log_path, "/v1/models", cwd=cwd)
    if kind == "mlx-lm":
        missing = mlx_lm_ok()
        if missing:
            raise RuntimeError(missing)
        run = mlx_lm_dir.run_folder(model, MODEL_NAME)  # converts the GGUF the first time
        return Server(kind, mlx_lm_dir.command(MODEL_NAME, int(port), cfg.lanes), log_path, "/health",
                      cwd=str(run), env=mlx_lm_dir.env(run), warm=warm_up)
    raise ValueError(f"unknown target {kind!r} (known: {', '.join(KINDS)})")


_PROMPT_EVAL = re.compile(r"prompt eval time\s*=\s*[\d.]+\s*ms\s*/\s*(\d+)\s*tokens")


def logged_prefill_tokens(log_text: str) -> int:
    """Prompt tokens a llama.cpp-based server evaluated, summed over its log's
    ``prompt eval time = … ms / N tokens`` lines (llama-cpp-python's verbose perf lines, llama-server's
    per-task timings)."""
    return sum(int(m.group(1)) for m in _PROMPT_EVAL.finditer(log_text))
