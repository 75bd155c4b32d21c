"""Starts a real ``superfluid serve`` on a free loopback port and always stops it (by PID)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import psutil

from superfluid.core import lifeline


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, args: list[str], log_path: Path, startup_timeout: float = 120.0,
                 env: dict[str, str] | None = None):
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        cmd = [sys.executable, "-m", "superfluid.core.cli", "serve", "--host", "127.0.0.1",
               "--port", str(self.port), *args]
        self._log = open(log_path, "wb")
        env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
        self.proc = lifeline.popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)
        self._wait_ready(startup_timeout)

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                with urllib.request.urlopen(self.base + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"server not ready in {timeout}s:\n{self.log()}")

    def get_json(self, path: str) -> dict:
        with urllib.request.urlopen(self.base + path, timeout=10) as r:
            return json.loads(r.read())

    def call(self, method: str, path: str, body: dict | None = None, timeout: float = 120) -> tuple[int, dict]:
        """(status, JSON body) of one request; an HTTP error status is returned, not raised."""
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.base + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read())

    def metrics(self) -> dict[str, float]:
        """Prometheus samples as {"name{labels}": value}."""
        with urllib.request.urlopen(self.base + "/metrics", timeout=10) as r:
            text = r.read().decode()
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                key, _, value = line.rpartition(" ")
                out[key] = float(value)
        return out

    def settled_metric(self, name: str, timeout: float = 3.0) -> float:
        """The sum of a metric's samples once two reads 0.1 s apart agree: a response can reach
        the client just before the scheduler records the tick that produced it."""
        def read() -> float:
            return sum(v for k, v in self.metrics().items() if k.split("{")[0] == name)
        value, deadline = read(), time.monotonic() + timeout
        while time.monotonic() < deadline:
            time.sleep(0.1)
            again = read()
            if again == value:
                break
            value = again
        return value

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-6000:]
        except OSError:
            return ""

    def stop(self, timeout: float = 20.0) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
        self._log.close()
        return self.proc.returncode


def still_running(held: list[psutil.Process], timeout: float = 20.0) -> list[psutil.Process]:
    """The processes of ``held`` still running after up to ``timeout`` s; a zombie counts as gone.
    A killed process whose parent died is a zombie until init reaps it, which some inits do only
    every second or so; it holds nothing by then, so waiting for the reaping measures init."""
    def running(proc: psutil.Process) -> bool:
        try:
            return proc.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    deadline = time.monotonic() + timeout
    while (alive := [p for p in held if running(p)]) and time.monotonic() < deadline:
        time.sleep(0.02)
    return alive
