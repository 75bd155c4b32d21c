"""``/v1/sessions...`` at the head: SMG does not proxy them, so the head sends each one to the
node that holds the session (:mod:`.sessions` says where, and why)."""

from __future__ import annotations

import asyncio
import json
import logging

import aiohttp
from aiohttp import web

from .body import body_model
from .nodes import NodeMonitor
from .relay import Relay, Unreachable, error, forward_headers
from .sessions import SessionMap

log = logging.getLogger("superfluid.fleet")


class SessionRoutes:
    def __init__(self, relay: Relay, monitor: NodeMonitor):
        self.relay = relay
        self.monitor = monitor
        self.sessions = SessionMap(monitor)

    def add_to(self, app: web.Application) -> None:
        app.router.add_post("/v1/sessions", self.create)
        app.router.add_get("/v1/sessions", self.list)
        app.router.add_route("*", "/v1/sessions/{sid}{tail:(/.*)?}", self.call)

    async def create(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        model = body_model(raw)
        node = self.sessions.place(model)
        if node is None and model is not None and model not in self.monitor.models():
            node = self.sessions.place(None)  # the node answers the 404 for an unknown model
        if node is None:
            return error(503, "no healthy node" + (f" serves model {model!r}" if model else ""),
                         "no_healthy_node", headers={"Retry-After": "2"})
        try:
            resp = await self.relay.call(request, node.url + "/v1/sessions", raw, forward_headers(request),
                                         node=node.url)
        except Unreachable as exc:
            return self.relay.node_down(node.url, str(exc))
        if resp.status == 201 and isinstance(resp, web.Response) and resp.body is not None:
            try:
                sid = json.loads(resp.body)["id"]
            except (ValueError, KeyError, TypeError):
                sid = None
            if isinstance(sid, str):
                self.sessions.remember(sid, node.url)
                log.info("session %s: on node %s", sid, node.url)
        return resp

    async def list(self, request: web.Request) -> web.Response:
        headers = forward_headers(request)

        async def one(url: str):
            try:
                async with self.relay.http.get(url + "/v1/sessions", headers=headers,
                                               timeout=aiohttp.ClientTimeout(total=10)) as resp:
                    return url, resp.status, await resp.read()
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
                return url, None, None

        data = []
        for url, status, body in await asyncio.gather(*(one(n.url) for n in self.monitor.healthy())):
            if status is None:
                continue
            if status != 200:  # e.g. the key's 401: the same on every node
                return web.Response(status=status, body=body, content_type="application/json")
            try:
                for s in json.loads(body).get("data", []):
                    data.append(s)
                    if isinstance(s, dict) and isinstance(s.get("id"), str):
                        self.sessions.remember(s["id"], url)
            except (ValueError, AttributeError):
                continue
        return web.json_response({"object": "list", "data": data})

    async def _find(self, request: web.Request, sid: str) -> str | None:
        """A session the head did not place (the head restarted; nodes keep sessions with
        --state-dir): ask the healthy nodes."""
        for node in self.monitor.healthy():
            try:
                async with self.relay.http.get(f"{node.url}/v1/sessions/{sid}", headers=forward_headers(request),
                                               timeout=aiohttp.ClientTimeout(total=5)) as resp:
                    if resp.status == 200:
                        self.sessions.remember(sid, node.url)
                        return node.url
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
                continue
        return None

    async def call(self, request: web.Request) -> web.StreamResponse:
        sid = request.match_info["sid"]
        url = self.sessions.node_of(sid) or await self._find(request, sid)
        if url is None:
            return error(404, f"No session with id {sid!r}", "session_not_found", "invalid_request_error",
                         "session_id")
        node = self.monitor.nodes.get(url)
        if node is None or not node.healthy:
            return self.relay.node_down(url, node.last_error if node else "no longer listed", sid)
        raw = await request.read() if request.can_read_body else None
        try:
            resp = await self.relay.call(request, url + request.path, raw, forward_headers(request), node=url)
        except Unreachable as exc:
            return self.relay.node_down(url, str(exc), sid)
        if request.method == "DELETE" and request.match_info["tail"] == "" and resp.status == 200:
            self.sessions.forget(sid)
        return resp
