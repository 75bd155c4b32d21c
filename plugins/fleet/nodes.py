"""The nodes the head knows, and what each one's ``/health`` said last.

The head polls every node's ``/health`` about once a second. That is its own view of the fleet
(``/health``, the per-node gauge, session placement) and it decides what SMG routes to: the head
registers with SMG only the nodes that answer healthy (:mod:`.smg`), and removes one that stops
answering (SMG drains it). So a node down at start, or back after dying, is routed to again
about a second after it answers; SMG left to itself retries a node it was given while down only
every 30 s.

The node list itself comes from ``--node`` / ``nodes = [...]`` and from a ``--discovery-file``
(SMG's manifest format), reread when it changes."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
from typing import Callable

import aiohttp
import attrs

from .config import node_url

log = logging.getLogger("superfluid.fleet")

POLL_S = 1.0
TIMEOUT_S = 2.0
FAILURES_TO_DOWN = 2  # consecutive failed polls before a healthy node is reported unhealthy


@attrs.define
class Node:
    """One node as the head last saw it."""

    url: str
    healthy: bool = False
    state: str = "unknown"  # unknown (not polled yet) | healthy | unhealthy
    last_error: str | None = None
    models: tuple[str, ...] = ()
    busy: int = 0  # lanes busy + queued, summed over its models
    failures: int = 0
    since: float = attrs.field(factory=time.time)  # when the state last changed
    checked: float = 0.0

    def view(self) -> dict:
        return {"url": self.url, "state": self.state, "last_error": self.last_error,
                "models": list(self.models), "busy": self.busy, "since": round(self.since, 3)}


def read_discovery(path: str) -> list[str]:
    """Node URLs from a discovery file: SMG's manifest ``{"version": 1, "workers": [{"url"}]}``
    (a bare list of URLs is accepted too). Raises ValueError naming the file and the entry."""
    with open(path, "rb") as fh:
        data = json.loads(fh.read() or b"null")
    workers = data.get("workers") if isinstance(data, dict) else data
    if not isinstance(workers, list):
        raise ValueError(f"{path}: expected {{\"version\": 1, \"workers\": [{{\"url\": ...}}]}}")
    urls = []
    for i, w in enumerate(workers):
        url = w.get("url") if isinstance(w, dict) else w
        try:
            urls.append(node_url(url, f"{path}: workers[{i}].url"))
        except Exception as exc:  # ConfigError: keep its message
            raise ValueError(str(exc)) from None
    return urls


def _count(value) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


class NodeMonitor:
    """Polls the nodes, keeps :class:`Node` records, and tells ``on_change`` which nodes are
    healthy whenever that set changes."""

    def __init__(self, static: tuple[str, ...], discovery_file: str | None,
                 on_change: Callable[[list[str]], None], ssl=None):
        self.static = tuple(static)
        self.discovery_file = discovery_file
        self.on_change = on_change
        self.nodes: dict[str, Node] = {u: Node(u) for u in self.static}
        self._discovered_mtime: float | None = None
        self._healthy_set: tuple[str, ...] | None = None
        self._task: asyncio.Task | None = None
        self._session: aiohttp.ClientSession | None = None
        self.changed = asyncio.Event()
        self.ssl = ssl  # an SSLContext verifying https:// nodes (--ssl-cafile); None: the default

    def healthy(self, model: str | None = None) -> list[Node]:
        return [n for n in self.nodes.values() if n.healthy and (model is None or model in n.models)]

    def models(self) -> dict[str, list[str]]:
        """Model name -> the URLs of every known node that last reported it (healthy or not)."""
        out: dict[str, list[str]] = {}
        for n in self.nodes.values():
            for m in n.models:
                out.setdefault(m, []).append(n.url)
        return out

    async def start(self) -> None:
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=TIMEOUT_S),
                                              connector=aiohttp.TCPConnector(ssl=self.ssl or True))
        self._reload_discovery()
        await self.poll_once()
        self._task = asyncio.create_task(self._run(), name="fleet-node-poll")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._session is not None:
            await self._session.close()

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(POLL_S)
            try:
                self._reload_discovery()
                await self.poll_once()
            except asyncio.CancelledError:
                raise
            except Exception:  # one bad round must not stop the polling
                log.exception("node poll failed")

    def _reload_discovery(self) -> None:
        if not self.discovery_file:
            return
        try:
            mtime = os.stat(self.discovery_file).st_mtime
        except OSError:
            if self._discovered_mtime is None:
                return  # not there yet: SMG's own file discovery allows that too
            mtime = -1.0
        if mtime == self._discovered_mtime:
            return
        self._discovered_mtime = mtime
        try:
            urls = read_discovery(self.discovery_file) if mtime >= 0 else []
        except (OSError, ValueError) as exc:
            log.warning("discovery file %s: %s; keeping the last good list", self.discovery_file, exc)
            return
        wanted = set(self.static) | set(urls)
        for url in wanted - set(self.nodes):
            log.info("node %s: added (discovery file)", url)
            self.nodes[url] = Node(url)
        for url in set(self.nodes) - wanted:
            log.info("node %s: removed (discovery file)", url)
            del self.nodes[url]

    async def poll_once(self) -> None:
        await asyncio.gather(*(self._poll(n) for n in list(self.nodes.values())))
        healthy = tuple(sorted(n.url for n in self.nodes.values() if n.healthy))
        if healthy != self._healthy_set:
            self._healthy_set = healthy
            self.on_change(list(healthy))
            self.changed.set()
            self.changed = asyncio.Event()

    async def _poll(self, node: Node) -> None:
        error = None
        body: dict = {}
        try:
            async with self._session.get(node.url + "/health") as resp:
                try:
                    body = await resp.json(content_type=None)
                except (ValueError, aiohttp.ContentTypeError):
                    body = {}
                if resp.status != 200:
                    error = f"/health answered {resp.status} ({body.get('status', 'no status') if isinstance(body, dict) else ''})"
        except asyncio.TimeoutError:
            error = f"/health did not answer within {TIMEOUT_S:g} s"
        except aiohttp.ClientError as exc:
            error = f"{type(exc).__name__}: {exc}"
        node.checked = time.time()
        models = body.get("models") if isinstance(body, dict) else None
        if isinstance(models, dict):
            node.models = tuple(name for name, m in models.items()
                                if not (isinstance(m, dict) and m.get("state") in ("unloaded", "loading")))
            node.busy = sum(_count(m.get("lanes_busy")) + _count(m.get("queued"))
                            for m in models.values() if isinstance(m, dict))
        if error is None:
            node.failures = 0
            node.last_error = None
            if not node.healthy:
                log.info("node %s: healthy (models: %s)%s", node.url, ", ".join(node.models) or "none",
                         "" if node.state == "unknown" else f", after {time.time() - node.since:.1f} s down")
                node.healthy, node.state, node.since = True, "healthy", time.time()
            return
        node.failures += 1
        node.last_error = error
        down = node.state == "unknown" or node.failures >= FAILURES_TO_DOWN
        if down and node.state != "unhealthy":
            log.warning("node %s: unhealthy: %s", node.url, error)
            node.healthy, node.state, node.since = False, "unhealthy", time.time()
