"""The head's HTTP front: a small aiohttp app in front of SMG that adds only what SMG lacks.

- OpenAI routes (chat, completions, embeddings, ``/v1/models``) go through SMG. SMG drops every
  ``x-superfluid-*`` request header, so a client's ``x-superfluid-qos`` is moved into the body's
  ``superfluid: {"qos": ...}`` (a body that already names a class keeps it: the node lets the
  body win too). ``Authorization`` passes untouched; the nodes check keys and cap the class.
  SMG re-serializes embeddings requests without unknown fields and drops the header, so an
  embeddings request that names a class goes straight to a node that serves its model, as sent.
  So does a body that is not JSON: SMG's parser would answer it with its own 400; a node answers
  it as it would alone.
- ``/v1/sessions...`` (SMG does not proxy them): see :mod:`.session_routes`.
- A stream whose upstream ends without ``data: [DONE]`` (SMG itself died, say) gets an SSE error
  event and ``[DONE]`` from the head (:mod:`.relay`), so a client never hangs. SMG already ends a
  stream cut by a dying node that way and already retries a failed non-streamed request on
  another node; the head retries once more only when SMG itself could not be reached (it is
  being restarted).
- A node cut off from the network (its packets dropped) fails nothing: its connections go
  silent. When the head marks a node unhealthy (:meth:`FleetApp.nodes_changed`), the streams
  relayed from it end at once: a started one with an error event, one without a token yet is
  sent again elsewhere; a whole answer still waiting, which might be there, is sent again too
  and the first answer wins (:meth:`FleetApp._whole`).
- ``/health`` and ``/metrics``: the fleet's view (nodes, SMG, the head)."""

from __future__ import annotations

import asyncio
import logging
import time

import aiohttp
from aiohttp import web

from . import metrics as metrics_page
from .body import QOS_HEADER, body_class, body_model, carry_class, parses, wants_stream
from .dashboard_routes import DashboardRoutes
from .metrics import HeadMetrics
from .nodes import NodeMonitor
from .relay import NotStarted, Relay, Unreachable, error, forward_headers
from .session_routes import SessionRoutes
from .smg import Smg

log = logging.getLogger("superfluid.fleet")

SMG_WAIT_S = 15.0  # how long a request waits for a restarting SMG before its one retry
STREAM_RETRIES = 2  # a stream whose node failed before its first token is sent again this often
NODE_GONE_WAIT_S = 4.0  # ... once SMG no longer routes to that node (or after this long)


class FleetApp:
    def __init__(self, smg: Smg, monitor: NodeMonitor, head: HeadMetrics, policy: str, ssl=None):
        self.smg = smg
        self.monitor = monitor
        self.head = head
        self.policy = policy
        self.relay = Relay(head, ssl)  # ssl: the context https:// nodes are verified with
        self.session_routes = SessionRoutes(self.relay, monitor)
        self.dashboard_routes = DashboardRoutes(self.relay, monitor)
        self.started = int(time.time())
        self._restarts_seen = 0
        self._healthy: set[str] = set()

    # ---- app ------------------------------------------------------------------------------
    def make_app(self) -> web.Application:
        app = web.Application(middlewares=[self._count], client_max_size=64 * 1024 * 1024)
        r = app.router
        r.add_get("/health", self.health)
        r.add_get("/metrics", self.metrics)
        r.add_get("/v1/models", self.models)
        r.add_get("/v1/models/{id:.+}", self.model)
        r.add_post("/v1/chat/completions", self.openai)
        r.add_post("/v1/completions", self.openai)
        r.add_post("/v1/embeddings", self.embeddings)
        r.add_post("/tokenize", self.any_node)
        r.add_post("/detokenize", self.any_node)
        self.session_routes.add_to(app)
        self.dashboard_routes.add_to(app)
        r.add_route("*", "/{tail:.*}", self.to_smg)  # what SMG answers (its 404 for unknown routes)
        app.on_startup.append(self._open)
        app.on_cleanup.append(self._close)
        return app

    async def _open(self, app) -> None:
        await self.relay.open()

    async def _close(self, app) -> None:
        await self.relay.close()

    def nodes_changed(self, healthy: list[str]) -> None:
        """The healthy set changed: the streams of a node that left it end now (a partitioned
        node's connections go silent, they do not break; see :mod:`.relay`)."""
        now = set(healthy)
        for url in sorted(self._healthy - now):
            node = self.monitor.nodes.get(url)
            # whole answers say where they are only when they end: resend the waiting ones only if
            # SMG (its last /workers) had more requests on the node than the head knows of there
            load = self.smg.workers.get(url, {}).get("load")
            wholes = not isinstance(load, int) or load > self.relay.held_by(url)
            self.relay.node_lost(url, node.last_error if node else "no longer listed", wholes=wholes)
        self._healthy = now

    @web.middleware
    async def _count(self, request: web.Request, handler):
        route = request.match_info.route.resource.canonical if request.match_info.route.resource else "other"
        try:
            resp = await handler(request)
        except web.HTTPException as exc:
            self.head.requests.labels(route, str(exc.status)).inc()
            raise
        self.head.requests.labels(route, str(resp.status)).inc()
        return resp

    # ---- the upstream call ----------------------------------------------------------------

    async def _via_smg(self, request: web.Request, raw: bytes | None, whole: bool = False) -> web.StreamResponse:
        """``whole``: a generation answered whole (not streamed), which may be sent again if a
        node is lost while it waits (:meth:`_whole`)."""
        url = self.smg.base + request.path
        headers = forward_headers(request)
        if not self.smg.ready.is_set():  # SMG restarting, or not yet routing to its nodes
            await self.smg.wait_ready(SMG_WAIT_S)
        for attempt in range(STREAM_RETRIES + 1):
            try:
                if whole:
                    return await self._whole(request, url, raw, headers)
                return await self.relay.call(request, url, raw, headers)
            except NotStarted as exc:
                if attempt == STREAM_RETRIES:
                    return error(503, f"The fleet could not start this stream: {exc}; retry shortly",
                                 "node_unavailable", headers={"Retry-After": "2"})
                await self._node_gone(exc)
            except Unreachable as exc:
                why = str(exc)
                break
        self.head.errors.labels("smg_unreachable").inc()
        self.smg.unreachable(why)
        log.warning("%s %s: SMG unreachable (%s); retrying once when it is back", request.method, request.path, why)
        if await self.smg.wait_ready(SMG_WAIT_S):
            try:
                resp = await self.relay.call(request, url, raw, headers)
                self.head.errors.labels("retried").inc()
                return resp
            except Unreachable as exc:
                why = str(exc)
        return error(503, f"The fleet's router (SMG) is unavailable: {why}; retry shortly", "router_unavailable",
                     headers={"Retry-After": "1"})

    async def _node_gone(self, exc: NotStarted) -> None:
        """A stream failed on its node before its first token: wait (briefly) until SMG stops
        routing to that node, so the retry goes elsewhere."""
        self.head.errors.labels("stream_moved").inc()
        log.warning("a stream failed before its first token on node %s (%s); sending it again",
                    exc.node or "?", exc)
        await self._unrouted(exc.node)

    async def _unrouted(self, node: str | None) -> None:
        deadline = time.monotonic() + NODE_GONE_WAIT_S
        while node and self.smg.routable(node) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)

    async def _whole(self, request: web.Request, url: str, raw: bytes | None,
                     headers: dict[str, str]) -> web.StreamResponse:
        """A whole answer through SMG. SMG names the node only in the answer, so when a node it
        had requests on is lost (:meth:`nodes_changed`) while this one waits, it may be waiting on
        that node's silent connection: it is sent again (SMG no longer routes there) and the
        first of the two answers is the client's; the other call is cancelled (its node frees
        the lane). A call on a healthy node is usually ahead and wins, its copy cancelled while
        still queued: the cost of not knowing where it went."""
        suspect = asyncio.get_running_loop().create_future()
        first = asyncio.ensure_future(self.relay.call(request, url, raw, headers, suspect=suspect))
        calls = [first]
        try:
            await asyncio.wait([first, suspect], return_when=asyncio.FIRST_COMPLETED)
            if first.done():
                return first.result()
            lost = suspect.result()
            self.head.errors.labels("whole_resent").inc()
            log.warning("%s %s: a whole answer may wait on node %s, which was lost; sending it again",
                        request.method, request.path, lost)
            await self._unrouted(lost)
            if first.done():
                return first.result()
            calls.append(asyncio.ensure_future(self.relay.call(request, url, raw, headers)))
            pending, failure = set(calls), None
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for call in done:
                    if call.exception() is None:
                        return call.result()
                    failure = call.exception()
            raise failure
        finally:
            suspect.cancel()
            for call in calls:
                call.cancel()

    # ---- OpenAI routes --------------------------------------------------------------------
    async def openai(self, request: web.Request) -> web.StreamResponse:
        raw = carry_class(await request.read(), request.headers.get(QOS_HEADER))
        if not parses(raw):  # SMG would answer with its own parser's 400: give the node's, as
            return await self._direct(request, raw, None)  # a single server answers it
        down = self._all_down(body_model(raw))
        return down if down is not None else await self._via_smg(request, raw, whole=not wants_stream(raw))

    def _all_down(self, model: str | None) -> web.Response | None:
        """A 503 for a model the fleet serves but no healthy node does now (SMG, which no longer
        lists those nodes, would call the model unknown: a 404)."""
        holders = self.monitor.models().get(model) if model else None
        if not holders or self.monitor.healthy(model):
            return None
        return error(503, f"No healthy node serves model {model!r} now (its nodes: {', '.join(holders)}); "
                     f"retry shortly", "no_healthy_node", headers={"Retry-After": "2"})

    async def _direct(self, request: web.Request, raw: bytes, model: str | None) -> web.StreamResponse:
        """Straight to the least busy healthy node serving ``model`` (SMG if there is none: its
        404 for an unknown model, or its 503)."""
        candidates = self.monitor.healthy(model)
        if not candidates:
            return await self._via_smg(request, raw)
        node = min(candidates, key=lambda n: (n.busy, n.url))
        try:
            return await self.relay.call(request, node.url + request.path, raw, forward_headers(request),
                                         node=node.url)
        except Unreachable as exc:
            return self.relay.node_down(node.url, str(exc))

    async def embeddings(self, request: web.Request) -> web.StreamResponse:
        """SMG re-serializes embeddings bodies without unknown fields and drops the header, so a
        request that names a class (header or body) goes straight to a node, unchanged: the
        node answers it exactly as it would a direct request."""
        raw = await request.read()
        down = self._all_down(body_model(raw))
        if down is not None:
            return down
        if request.headers.get(QOS_HEADER) is None and body_class(raw) is None and parses(raw):
            return await self._via_smg(request, raw, whole=True)
        return await self._direct(request, raw, body_model(raw))

    async def any_node(self, request: web.Request) -> web.StreamResponse:
        """What every node serving the model answers alike (/tokenize, /detokenize; SMG has no
        such routes): straight to the least busy one. A model no node serves goes to any node,
        which answers its own 404, as a bad body gets its own 400."""
        raw = await request.read()
        model = body_model(raw)
        down = self._all_down(model)
        if down is not None:
            return down
        if model is not None and model not in self.monitor.models():
            model = None
        return await self._direct(request, raw, model)

    async def models(self, request: web.Request) -> web.StreamResponse:
        try:
            return await self.relay.call(request, self.smg.base + "/v1/models", None, forward_headers(request))
        except Unreachable:
            return web.json_response({"object": "list", "data": self._model_entries()})

    def _model_entries(self) -> list[dict]:
        return [{"id": m, "object": "model", "created": self.started, "owned_by": "superfluid"}
                for m in sorted(self.monitor.models())]

    async def model(self, request: web.Request) -> web.Response:
        name = request.match_info["id"]
        for entry in self._model_entries():
            if entry["id"] == name:
                return web.json_response(entry)
        return error(404, f"The model {name!r} does not exist; served models: "
                     f"{', '.join(sorted(self.monitor.models())) or 'none'}", "model_not_found",
                     "invalid_request_error", "model")

    async def to_smg(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read() if request.can_read_body else None
        return await self._via_smg(request, raw)

    # ---- sessions -------------------------------------------------------------------------

    # ---- the fleet's view -----------------------------------------------------------------
    async def health(self, request: web.Request) -> web.Response:
        nodes = {}
        routable = False
        for url, node in self.monitor.nodes.items():
            routed = self.smg.routable(url)
            nodes[url] = {**node.view(), "routed": routed}
            routable = routable or (node.healthy and routed)
        ok = self.smg.up and routable
        body = {"status": "ok" if ok else "degraded", "policy": self.policy,
                "smg": {"state": "up" if self.smg.up else "down", "url": self.smg.base,
                        "pid": self.smg.proc.pid if self.smg.proc else None, "restarts": self.smg.restarts,
                        "last_error": self.smg.last_error},
                "nodes": nodes}
        return web.json_response(body, status=200 if ok else 503)

    async def metrics(self, request: web.Request) -> web.Response:
        held: dict[str, int] = {}
        for url in self.session_routes.sessions.owner.values():
            held[url] = held.get(url, 0) + 1
        for url, node in self.monitor.nodes.items():
            self.head.node_healthy.labels(url).set(1 if node.healthy else 0)
            self.head.sessions.labels(url).set(held.get(url, 0))
        self.head.smg_up.set(1 if self.smg.up else 0)
        if self.smg.restarts > self._restarts_seen:
            self.head.smg_restarts.inc(self.smg.restarts - self._restarts_seen)
            self._restarts_seen = self.smg.restarts

        async def page(url: str):
            try:
                async with self.relay.http.get(url + "/metrics", timeout=aiohttp.ClientTimeout(total=3)) as resp:
                    return url, (await resp.text()) if resp.status == 200 else None
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
                return url, None

        pages = await asyncio.gather(*(page(n.url) for n in self.monitor.healthy()))
        texts = {url: text for url, text in pages if text}
        body = metrics_page.render(self.head, texts, await self.smg.metrics_text())
        return web.Response(body=body, content_type="text/plain", charset="utf-8")
