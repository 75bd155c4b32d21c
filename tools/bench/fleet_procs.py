"""The processes of the fleet bench: ``superfluid serve`` nodes and the head in front of them
(``superfluid fleet``, or SMG alone for comparison), each started in its own process group on a
free loopback port and always stopped by its PID.

A node is killed the way a machine dies: SIGKILL to its whole process group (the serve process
and its engine worker), with no chance to answer anything.
"""

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

from prometheus_client.parser import text_string_to_metric_families

from superfluid.core import lifeline

BIN = Path(sys.executable).parent  # the venv's bin/, where superfluid and smg live


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str, timeout: float = 5.0) -> tuple[int | None, str]:
    """(status, body) of one GET; (None, why) when nothing answered."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode(errors="replace")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")
    except (OSError, ValueError) as exc:
        return None, f"{type(exc).__name__}: {exc}"


def metric_sums(text: str) -> dict[str, float]:
    """Each sample name of a Prometheus text page with its values summed over labels."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[s.name] = out.get(s.name, 0.0) + s.value
    return out


class Proc:
    """One child process in its own session (so its PID is its process group's id)."""

    def __init__(self, name: str, cmd: list[str], log_path: Path):
        self.name, self.cmd, self.log_path = name, cmd, log_path
        self._log = open(log_path, "ab")
        self._log.write(f"\n$ {' '.join(cmd)}\n".encode())
        self._log.flush()
        self.proc = lifeline.popen(cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                     env=dict(os.environ, PYTHONUNBUFFERED="1"), start_new_session=True)
        self.pid = self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def wait_http(self, url: str, timeout: float, ok=lambda status, body: status == 200) -> float:
        """Seconds until ``url`` answers as ``ok`` says; raises if the process exits or time runs out."""
        t0 = time.monotonic()
        deadline = t0 + timeout
        while time.monotonic() < deadline:
            if not self.alive():
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self.tail()}")
            status, body = get(url, timeout=2.0)
            if status is not None and ok(status, body):
                return time.monotonic() - t0
            time.sleep(0.2)
        raise RuntimeError(f"{self.name}: {url} not ready in {timeout:.0f} s:\n{self.tail()}")

    def tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def kill(self) -> None:
        """SIGKILL the whole group: the machine is gone."""
        if self.alive():
            try:
                os.killpg(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait(10)

    def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM, then SIGKILL the group if it is still there after ``timeout``."""
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        try:  # the engine worker or SMG child may outlive its parent
            os.killpg(self.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        if self.alive():
            self.proc.wait(5)
        self._log.close()


class Node:
    """One ``superfluid serve`` on the default model."""

    def __init__(self, index: int, flags: list[str], log_dir: Path, port: int | None = None):
        self.index, self.flags, self.log_dir = index, flags, log_dir
        self.port = port or free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.proc: Proc | None = None
        self.starts = 0

    def start(self) -> None:
        self.starts += 1
        cmd = [str(BIN / "superfluid"), "serve", "--host", "127.0.0.1", "--port", str(self.port), *self.flags]
        self.proc = Proc(f"node{self.index}", cmd, self.log_dir / f"node{self.index}.log")

    def wait_ready(self, timeout: float = 180.0) -> float:
        assert self.proc is not None
        return self.proc.wait_http(self.base + "/health", timeout)

    def metrics(self) -> dict[str, float]:
        status, body = get(self.base + "/metrics", timeout=10.0)
        if status != 200:
            raise RuntimeError(f"node{self.index} /metrics: {status} {body[:200]}")
        return metric_sums(body)

    def health(self) -> dict:
        status, body = get(self.base + "/health", timeout=5.0)
        try:
            return json.loads(body) if status == 200 else {}
        except ValueError:
            return {}

    def busy(self) -> int:
        """Lanes busy plus requests queued, from the node's /health."""
        models = self.health().get("models") or {}
        return sum(int(m.get("lanes_busy") or 0) + int(m.get("queued") or 0) for m in models.values())

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop()

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()


class Head:
    """The router in front of the nodes: ``superfluid fleet`` (kind "fleet") or ``smg launch``
    (kind "smg", SMG alone with the flags the head would give it)."""

    def __init__(self, kind: str, nodes: list[Node], policy: str, log_dir: Path, tag: str = ""):
        self.kind, self.nodes, self.policy = kind, nodes, policy
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        urls = [n.base for n in nodes]
        if kind == "fleet":
            cmd = [str(BIN / "superfluid"), "fleet", "--host", "127.0.0.1", "--port", str(self.port),
                   "--policy", policy]
            for u in urls:
                cmd += ["--node", u]
        elif kind == "smg":
            # SMG's regular HTTP router, the mode the head runs it in (its "openai" mode has no
            # /v1/completions, no /v1/models and no routing by model).
            cmd = [str(BIN / "smg"), "launch", "--worker-urls", *urls, "--backend", "sglang",
                   "--policy", policy, "--host", "127.0.0.1", "--port", str(self.port),
                   "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
                   "--health-check-interval-secs", "1", "--health-failure-threshold", "2"]
        else:
            raise ValueError(f"unknown head kind {kind!r}")
        self.proc = Proc(f"{kind}-{policy}{tag}", cmd, log_dir / f"head-{kind}-{policy}{tag}.log")

    def wait_ready(self, timeout: float = 60.0) -> float:
        """Until /health is 200 and every node answers a chat through it (SMG adds its workers
        in the background after it listens)."""
        return self.proc.wait_http(self.base + "/health", timeout)

    def health(self) -> tuple[int | None, str]:
        return get(self.base + "/health", timeout=3.0)

    def node_healthy(self, node: Node, key: str = "healthy") -> bool | None:
        """Whether the head calls ``node`` healthy (``key="healthy"``) or routes to it
        (``key="routed"``): the fleet head's /health names each node with both; SMG alone lists
        its workers on /workers (one verdict for both). None when the head says nothing."""
        status, body = self.health()
        try:
            data = json.loads(body)
        except ValueError:
            data = None
        verdict = node_state(data, node.base, key)
        if verdict is not None:
            return verdict
        status, body = get(self.base + "/workers", timeout=3.0)
        try:
            data = json.loads(body) if status == 200 else None
        except ValueError:
            data = None
        return node_state(data, node.base)

    def metric(self, name: str) -> float | None:
        """A sample's sum on the head's /metrics (the fleet head's page includes SMG's own
        series); None where the head has no such page or no such series."""
        status, body = get(self.base + "/metrics", timeout=10.0)
        if status != 200:
            return None
        try:
            return metric_sums(body).get(name)
        except ValueError:
            return None

    def stop(self) -> None:
        self.proc.stop()


def node_state(data, url: str, key: str = "healthy") -> bool | None:
    """Find ``url`` in a health document (a list or mapping of nodes, SMG's ``workers`` list or
    the fleet head's ``nodes``) and read whether it is healthy (or, ``key="routed"``, routed to
    when the document says so apart); None if it is not there or its state is not known yet."""
    url = url.rstrip("/")
    entries = []
    if isinstance(data, dict):
        for name in ("nodes", "workers"):
            value = data.get(name)
            if isinstance(value, list):
                entries += [e for e in value if isinstance(e, dict)]
            elif isinstance(value, dict):
                entries += [dict(v, url=k) if isinstance(v, dict) else {"url": k, "status": v}
                            for k, v in value.items()]
    for e in entries:
        if str(e.get("url", "")).rstrip("/") != url:
            continue
        if key == "routed" and isinstance(e.get("routed"), bool):
            return e["routed"]
        for name in ("is_healthy", "healthy"):
            if isinstance(e.get(name), bool):
                return e[name]
        state = str(e.get("state", e.get("status", ""))).lower()
        if state in ("ok", "healthy", "ready", "up"):
            return True
        if state in ("unhealthy", "failed", "down", "dead"):
            return False
        return None
    return None
