"""SMG, the fleet's data plane: started, watched and restarted by the head.

SMG (Shepherd Model Gateway) routes each OpenAI request to a node by its policy (cache_aware by
default), by ``model`` (it learns each node's models from its ``/v1/models``: a node gets only
requests for its own models, an unknown model is SMG's 404 ``model_not_found``), retries a
non-streamed request on another node when its node fails, and ends a stream cut by a dying node
with an SSE error event and ``[DONE]``. It runs in its HTTP ("regular") router mode, not
``--backend openai`` (that mode proxies chat only and does not route by model).

The nodes reach SMG through its worker admin API (``POST /workers``, ``DELETE /workers/{id}``):
the head keeps SMG's worker list equal to the nodes whose ``/health`` answers (see :mod:`.nodes`
for why only healthy ones), each registered with the models its ``/health`` lists. Naming the
models matters: SMG would otherwise ask the node's ``/v1/models``, which a node with a key
policy answers with a 401, so SMG could not route to it at all (its file discovery has no such
field for several models, nor its ``--api-key``, which would also gate every client). The list
is reconciled every half second, so an SMG that restarts empty gets its nodes back at once."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from typing import Callable

import aiohttp

from superfluid.core import lifeline

log = logging.getLogger("superfluid.fleet.smg")

RESTART_BACKOFF_S = (0.2, 0.5, 1.0, 2.0, 5.0)  # after the 1st, 2nd, ... consecutive quick death
STABLE_S = 30.0  # an SMG that ran this long resets the backoff
PENDING_S = 3.0  # a registration SMG accepted (202) is not sent again for this long
# SMG's --shutdown-grace-period-secs. Even idle, SMG waits half of it after SIGTERM (2.5 s of the
# 5), so every head's stop took that long; SUPERFLUID_TEST_SMG_GRACE_S is a test-only override
# (seconds, whole) that lets the fleet tests stop their heads at once.
SHUTDOWN_GRACE_S = int(os.environ.get("SUPERFLUID_TEST_SMG_GRACE_S") or 5)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Smg:
    """One supervised ``smg launch`` on 127.0.0.1."""

    def __init__(self, policy: str, port: int = 0, log_level: str = "info",
                 desired: Callable[[], dict[str, tuple[str, ...]]] = dict, ca_file: str | None = None):
        self.policy = policy
        self.ca_file = ca_file  # --ssl-cafile: SMG verifies https:// nodes with it too
        self.desired = desired  # node URL -> its models: what SMG should route to
        self.port = port or free_port()
        self.metrics_port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log_level = log_level
        # SMG's worker API would let anyone on this host add or remove backends: only the head may
        self._admin_key = secrets.token_urlsafe(24)
        self.proc: subprocess.Popen | None = None
        self.restarts = 0
        self.up = False  # SMG's own /health answered at the last check
        self.workers: dict[str, dict] = {}  # node URL -> SMG's /workers entry
        self.last_error: str | None = None
        self._pending: dict[str, float] = {}  # node URL -> when its registration was accepted
        self._poke = asyncio.Event()  # the healthy set changed: reconcile now, not at the next tick
        self.ready = asyncio.Event()  # set while SMG answers and routes to a listed node
        self._task: asyncio.Task | None = None
        self._stopping = False
        self._session: aiohttp.ClientSession | None = None

    def argv(self) -> list[str]:
        smg_level = {"debug": "info", "info": "error", "warning": "error", "error": "error"}[self.log_level]
        return [sys.executable, "-m", "smg", "launch",
                "--host", "127.0.0.1", "--port", str(self.port),
                "--policy", self.policy,
                "--enable-igw",  # several models; workers come from POST /workers
                # SMG's own health checks catch a dead node between two of the head's polls
                "--health-check-interval-secs", "1", "--health-failure-threshold", "2",
                "--health-success-threshold", "1", "--health-check-timeout-secs", "2",
                "--control-plane-api-keys", f"fleet-head:superfluid fleet:admin:{self._admin_key}",
                "--shutdown-grace-period-secs", str(SHUTDOWN_GRACE_S),
                "--prometheus-host", "127.0.0.1", "--prometheus-port", str(self.metrics_port),
                "--log-level", smg_level] + (["--ca-cert-paths", self.ca_file] if self.ca_file else [])

    async def start(self) -> None:
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2),
                                              headers={"Authorization": f"Bearer {self._admin_key}"})
        self._spawn()
        self._task = asyncio.create_task(self._supervise(), name="fleet-smg")

    def _spawn(self) -> None:
        self.proc = lifeline.popen(self.argv(), stdin=subprocess.DEVNULL, start_new_session=True)
        self.started_at = time.monotonic()
        self._pending.clear()
        log.info("SMG started (pid %d) on %s, policy %s", self.proc.pid, self.base, self.policy)

    async def _supervise(self) -> None:
        quick_deaths = 0
        while not self._stopping:
            try:
                await asyncio.wait_for(self._poke.wait(), 0.5)
            except asyncio.TimeoutError:
                pass
            self._poke.clear()
            code = self.proc.poll()
            if code is None:
                await self._check()
                if self.up:
                    await self.reconcile()
                continue
            if self._stopping:
                break
            self._set_down(f"SMG exited with status {code}")
            ran = time.monotonic() - self.started_at
            quick_deaths = 0 if ran >= STABLE_S else quick_deaths + 1
            delay = RESTART_BACKOFF_S[min(quick_deaths, len(RESTART_BACKOFF_S) - 1)]
            self.restarts += 1
            log.warning("SMG (pid %d) exited with status %s after %.1f s; restarting it in %.1f s (restart %d)",
                        self.proc.pid, code, ran, delay, self.restarts)
            await asyncio.sleep(delay)
            if not self._stopping:
                self._spawn()

    async def _check(self) -> None:
        """SMG's /health and its worker list (which nodes it routes to, and their state)."""
        try:
            async with self._session.get(self.base + "/health") as resp:
                ok = resp.status == 200
            async with self._session.get(self.base + "/workers") as resp:
                data = await resp.json(content_type=None)
            self.workers = {w.get("url"): w for w in data.get("workers", []) if isinstance(w, dict)}
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, AttributeError) as exc:
            self._set_down(f"{type(exc).__name__}: {exc}")
            return
        if ok and not self.up:
            log.info("SMG is up on %s", self.base)
        self.up = ok
        self.last_error = None if ok else "SMG /health did not answer 200"
        # a (re)started SMG answers /health before its nodes are registered again
        desired = self.desired()
        if ok and (not desired or any(self.routable(u) for u in desired)):
            self.ready.set()
        else:
            self.ready.clear()

    def nodes_changed(self) -> None:
        """The set of healthy nodes changed: bring SMG's worker list in line at once."""
        self._poke.set()

    async def reconcile(self) -> None:
        """Make SMG's worker list the healthy nodes: register the missing ones (with their
        models), remove the ones no longer healthy (SMG drains them first)."""
        desired = self.desired()
        now = time.monotonic()
        for url, models in desired.items():
            w = self.workers.get(url)
            have = {m.get("id") for m in (w or {}).get("models") or [] if isinstance(m, dict)}
            if w is not None and have == set(models):
                self._pending.pop(url, None)
                continue
            if w is not None and w.get("status") != "draining":  # its models changed: again
                await self._remove(url, w, "its models changed")
                continue
            if w is None and now - self._pending.get(url, -PENDING_S) >= PENDING_S:
                await self._add(url, models)
        for url, w in list(self.workers.items()):
            if url not in desired and w.get("status") != "draining":
                await self._remove(url, w, "not healthy")

    async def _add(self, url: str, models: tuple[str, ...]) -> None:
        spec = {"url": url, "runtime_type": "generic", "models": [{"id": m} for m in models]}
        try:
            async with self._session.post(self.base + "/workers", json=spec) as resp:
                text = await resp.text()
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            log.warning("SMG: could not register node %s: %s", url, exc)
            return
        if resp.status in (200, 201, 202):
            self._pending[url] = time.monotonic()
            log.info("SMG: node %s registered (models: %s)", url, ", ".join(models))
        elif resp.status != 409:  # 409: already there (an earlier registration went through)
            log.warning("SMG: registering node %s answered %d: %s", url, resp.status, text[:300])

    async def _remove(self, url: str, worker: dict, why: str) -> None:
        try:
            async with self._session.delete(f"{self.base}/workers/{worker.get('id')}") as resp:
                ok = resp.status in (200, 202, 204, 404)
        except (aiohttp.ClientError, asyncio.TimeoutError):
            ok = False
        if ok:
            self._pending.pop(url, None)
            log.info("SMG: node %s removed (%s)", url, why)

    def unreachable(self, error: str) -> None:
        """A request could not reach SMG: not ready until the next check says otherwise."""
        self._set_down(error)

    def _set_down(self, error: str) -> None:
        if self.up:
            log.warning("SMG is down: %s", error)
        self.up = False
        self.last_error = error
        self.workers = {}
        self.ready.clear()

    def routable(self, url: str) -> bool:
        w = self.workers.get(url)
        return bool(w and w.get("is_healthy") and w.get("status", "ready") == "ready")

    async def wait_ready(self, timeout: float) -> bool:
        try:
            await asyncio.wait_for(self.ready.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False

    async def metrics_text(self) -> str | None:
        try:
            async with self._session.get(f"http://127.0.0.1:{self.metrics_port}/metrics") as resp:
                return await resp.text() if resp.status == 200 else None
        except (aiohttp.ClientError, asyncio.TimeoutError):
            return None

    async def stop(self) -> None:
        self._stopping = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                for _ in range(50):
                    if self.proc.poll() is not None:
                        break
                    await asyncio.sleep(0.1)
                else:
                    os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(5)
        if self._session is not None:
            await self._session.close()
