"""What every chaos scenario shares: the context it runs in (parameters, a seed, the servers it
started, stopped by PID however the run ends) and the outcome it returns.

A scenario module declares:

* ``KEY``, ``TITLE``;
* ``FAULT`` and ``PASS``: one sentence each, printed in the table beside the verdict;
* ``FAST`` and ``FULL``: its parameters for the CI variant and for the full run;
* ``HEADLINE``: the figures the table shows;
* ``unavailable() -> str | None``: why this machine cannot inject the fault (not root, no memory
  cgroup, no network namespaces): the verdict is then n/a with that reason, never a silent pass;
* ``run(ctx) -> Outcome``: inject the fault, check the pass condition from what it measured.

Outcomes, verdicts and the HTTP helpers are the serving suite's (:mod:`tools.suite.common`)."""

from __future__ import annotations

import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from tools.suite.common import ERROR, FAIL, NA, PASS, SYMBOL, Outcome, verdict  # noqa: F401 (re-exported)
from tools.suite.targets import MODEL_NAME, Server, free_port

__all__ = ["Ctx", "ERROR", "FAIL", "NA", "PASS", "SYMBOL", "MODEL_NAME", "Outcome", "verdict", "free_port"]


@dataclass
class Ctx:
    """One scenario's run: its parameters, a seeded random source, a folder for its logs and
    files, and every process it started (stopped, last started first, when the run ends)."""

    key: str
    p: dict[str, Any]
    seed: int
    out_dir: Path
    model: str
    fast: bool
    rng: random.Random = field(init=False)
    servers: list[Server] = field(default_factory=list)
    cleanups: list[Callable[[], None]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        self.out_dir.mkdir(parents=True, exist_ok=True)

    def log_path(self, name: str) -> Path:
        path = self.out_dir / "logs" / f"{self.key}-{name}.log"
        path.parent.mkdir(parents=True, exist_ok=True)
        return path

    def serve(self, *flags: str, name: str = "serve", netns: str | None = None, host: str = "127.0.0.1",
              port: int | None = None, env: dict[str, str] | None = None, prefix: list[str] | None = None,
              startup_timeout: float = 180.0) -> Server:
        """Start ``superfluid serve`` on the default model (``--model-name smollm2``) with ``flags``,
        ready when /health answers. ``netns``: inside that network namespace, listening on
        ``host``; ``prefix``: a command that execs the server (it keeps the PID, so the stop by PID
        still reaches it)."""
        port = port or free_port()
        cmd = [sys.executable, "-m", "superfluid.core.cli", "serve", "--model", self.model, "--model-name",
               MODEL_NAME, "--host", host, "--port", str(port), *flags]
        if netns:
            cmd = ["ip", "netns", "exec", netns, *cmd]
        if prefix:
            cmd = [*prefix, *cmd]
        log = self.log_path(name)
        log.write_bytes(b"")
        srv = Server("superfluid", cmd, log, "/health", env=env, host=host, startup_timeout=startup_timeout)
        self.servers.append(srv)
        return srv

    def on_cleanup(self, fn: Callable[[], None]) -> None:
        """Undo a fault (unmount, delete a namespace or cgroup) when the run ends, after the servers."""
        self.cleanups.append(fn)

    def close(self) -> None:
        for srv in reversed(self.servers):
            try:
                srv.stop()
            except Exception as e:  # keep stopping the rest
                print(f"chaos: stopping {srv.pid}: {e}", file=sys.stderr)
        for fn in reversed(self.cleanups):
            try:
                fn()
            except Exception as e:
                print(f"chaos: cleanup: {e}", file=sys.stderr)
        self.servers.clear()
        self.cleanups.clear()


def wait_for(check: Callable[[], Any], timeout: float, every: float = 0.1) -> Any:
    """Poll ``check`` until it returns something truthy; that value, or None past ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value or time.monotonic() > deadline:
            return value or None
        time.sleep(every)
