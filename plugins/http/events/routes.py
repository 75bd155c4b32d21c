"""GET /events (the live event stream, SSE) and GET /dashboard (the page that draws it).

Both follow the key policy: without one they are open like /slots; with one they need an admin
key or a key with ``dashboard = true``, else a 403 ``dashboard_not_allowed``. A browser's
EventSource cannot send headers, so these two routes (and only these) also take the key as
``?key=SECRET`` (see keys/auth.py); no log line prints a query string."""

from __future__ import annotations

import logging
import socket
from pathlib import Path

from aiohttp import web

from superfluid.core.errors import InvalidRequest, ModelNotFound, SuperfluidError

from ..keys.auth import Forbidden, request_key
from .hub import INTERVAL_MS, EventHub

log = logging.getLogger("superfluid.http")

DASHBOARD = Path(__file__).parent.parent / "static" / "dashboard.html"
QUERY = ("model", "interval_ms", "key")
STEP_MS = 100
SEND_BUFFER = 128 * 1024  # bytes of kernel send buffer per stream: minutes of snapshots, bounded


class DashboardMissing(SuperfluidError):
    status = 404
    type = "not_found_error"
    code = "dashboard_not_installed"


def check_watcher(request) -> None:
    """The door of /events and /dashboard: with a key policy, admin or the dashboard grant."""
    key = request_key(request)
    if key is not None and not (key.admin or key.dashboard):
        log.warning("key %s: refused %s %s (no dashboard grant)", key.name, request.method, request.path)
        raise Forbidden(f"key {key.name!r} may not watch the server: it needs admin = true or dashboard = true "
                        "in the key policy", code="dashboard_not_allowed")


def parse_query(query) -> tuple[int, str | None]:
    """(interval_ms, model) of an /events request; a 400 naming the parameter if bad."""
    for name in query:
        if name not in QUERY:
            raise InvalidRequest(f"unknown query parameter {name!r}; /events takes {', '.join(QUERY)}", param=name,
                                 code="unknown_parameter")
    low, high, default = INTERVAL_MS
    raw = query.get("interval_ms")
    interval = default
    if raw is not None:
        try:
            interval = int(raw)
        except ValueError:
            interval = None
        if interval is None or not low <= interval <= high:
            raise InvalidRequest(f"interval_ms must be an integer from {low} to {high}, got {raw!r}",
                                 param="interval_ms", code="invalid_interval")
    # to a multiple of 100 ms (hello says which): readers share a channel per interval and model,
    # so however many streams ask, the snapshots built stay bounded (the sum of 10/k per second)
    interval = max(low, int(interval / STEP_MS + 0.5) * STEP_MS)
    return interval, query.get("model")


class EventsRoutes:
    def __init__(self, daemon, hub: EventHub):
        self.daemon, self.hub = daemon, hub

    def add_to(self, app: web.Application) -> None:
        app.router.add_get("/events", self.events)
        app.router.add_get("/dashboard", self.dashboard)
        app.on_shutdown.append(self.hub.shutdown)

    async def events(self, request: web.Request) -> web.StreamResponse:
        check_watcher(request)
        interval, model = parse_query(request.query)
        if model is not None and model not in self.daemon.models:
            self.daemon.get(model)  # the 404 naming the served models (503 while unloaded or loading)
            raise ModelNotFound(f"The model {model!r} does not exist; served models: "
                                f"{', '.join(self.daemon.models) or 'none'}", param="model")
        reader = self.hub.open(interval, model)  # 503 beyond the reader cap, before any byte is sent
        try:
            response = web.StreamResponse(headers={
                "Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                "X-Accel-Buffering": "no"})  # nginx: pass each event on at once
            await response.prepare(request)
            await response.write(self.hub.hello(interval))
        except BaseException:
            self.hub.close(reader)
            raise
        transport = request.transport
        sock = transport.get_extra_info("socket") if transport is not None else None
        if sock is not None:  # a stalled reader holds at most this much in the kernel (no autotuning to 4 MiB)
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER)
            except OSError:
                pass
        await self.hub.stream(reader, response.write, transport.abort if transport is not None else None,
                              peer=request.remote or "-")
        return response

    async def dashboard(self, request: web.Request) -> web.Response:
        check_watcher(request)
        try:
            page = DASHBOARD.read_bytes()
        except OSError:
            raise DashboardMissing("the dashboard page is not installed (plugins/http/static/dashboard.html); "
                                   "GET /events serves the same data") from None
        # the page may carry ?key=: no Referer leaves it, and no cache keeps it
        return web.Response(body=page, content_type="text/html", charset="utf-8",
                            headers={"Cache-Control": "no-store", "Referrer-Policy": "no-referrer",
                                     "X-Content-Type-Options": "nosniff"})
