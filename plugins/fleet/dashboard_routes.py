"""The fleet head's dashboards: ``/dashboard`` lists the nodes, and ``/nodes/{id}/dashboard``
is that node's own live page, its ``/events`` stream relayed by the head.

The head keeps no scheduler, so it has no lanes or queues of its own to show; each node's page
is the truth about that node. The page reads ``events`` beside its own path, so relaying
``/nodes/{id}/dashboard`` and ``/nodes/{id}/events`` serves the node's page unchanged through
the head. Keys stay the node's business: a ``?key=`` the page was opened with travels to the
node, which checks it (admin or the ``dashboard`` grant)."""

from __future__ import annotations

import hashlib
import html

from aiohttp import web

from .nodes import NodeMonitor
from .relay import Relay, Unreachable, error, forward_headers


def node_id(url: str) -> str:
    """A short id for a node's URL that stays the same while nodes come and go."""
    return hashlib.blake2b(url.encode(), digest_size=4).hexdigest()


class DashboardRoutes:
    def __init__(self, relay: Relay, monitor: NodeMonitor):
        self.relay = relay
        self.monitor = monitor

    def add_to(self, app: web.Application) -> None:
        app.router.add_get("/dashboard", self.index)
        app.router.add_get("/nodes/{node}/dashboard", self.node_page)
        app.router.add_get("/nodes/{node}/events", self.node_events)

    async def index(self, request: web.Request) -> web.Response:
        key = request.query.get("key")
        query = f"?key={html.escape(key)}" if key else ""
        rows = []
        for node in sorted(self.monitor.nodes.values(), key=lambda n: n.url):
            link = f"nodes/{node_id(node.url)}/dashboard{query}"
            models = ", ".join(node.models) or "–"
            rows.append(f'<tr data-node="{html.escape(node.url)}" data-state="{node.state}"><td>'
                        f'<a href="{link}">{html.escape(node.url)}</a></td><td>{node.state}</td>'
                        f'<td>{html.escape(models)}</td><td>{node.busy}</td></tr>')
        page = ("<!doctype html><meta charset=utf-8><title>superfluid fleet</title>"
                "<style>body{font:14px system-ui;margin:2em}td,th{padding:4px 12px;text-align:left}</style>"
                "<h1>superfluid fleet</h1><p>Each node's own live dashboard:</p>"
                "<table><tr><th>node</th><th>state</th><th>models</th><th>busy + queued</th></tr>"
                + "".join(rows) + "</table>")
        return web.Response(text=page, content_type="text/html")

    def _node(self, request: web.Request) -> str | None:
        wanted = request.match_info["node"]
        return next((url for url in self.monitor.nodes if node_id(url) == wanted), None)

    async def node_page(self, request: web.Request) -> web.StreamResponse:
        return await self._relay(request, "/dashboard")

    async def node_events(self, request: web.Request) -> web.StreamResponse:
        return await self._relay(request, "/events")

    async def _relay(self, request: web.Request, path: str) -> web.StreamResponse:
        url = self._node(request)
        if url is None:
            return error(404, f"no node {request.match_info['node']!r} in this fleet; GET /dashboard lists them",
                         "node_not_found", type_="invalid_request_error")
        try:
            return await self.relay.call(request, url + path, None, forward_headers(request), completion=False,
                                         node=url)
        except Unreachable as exc:
            return error(503, f"node {url} is unavailable: {exc}", "node_unavailable", headers={"Retry-After": "2"})
