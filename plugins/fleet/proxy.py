"""The head's HTTP front: a small aiohttp app in front of SMG that adds only what SMG lacks.

- OpenAI routes (chat, completions, embeddings, ``/v1/models``) go through SMG. SMG drops every
  ``x-superfluid-*`` request header, so a client's ``x-superfluid-qos`` is moved into the body's
  ``superfluid: {"qos": ...}`` (a body that already names a class keeps it: the node lets the
  body win too). ``Authorization`` passes untouched; the nodes check keys and cap the class.
  SMG re-serializes embeddings requests without unknown fields and drops the header, so an
  embeddings request that names a class goes straight to a node that serves its model, as sent.
  So does a body that is not JSON: SMG's parser would answer it with its own 400; a node answers
  it as it would alone.
- ``/v1/sessions...`` (SMG does not proxy them): see :mod:`.sessions`.
- A stream whose upstream ends without ``data: [DONE]`` (SMG itself died, say) gets an SSE error
  event and ``[DONE]`` from the head, so a client never hangs. SMG already ends a stream cut by a
  dying node that way and already retries a failed non-streamed request on another node; the
  head retries once more only when SMG itself could not be reached (it is being restarted).
- ``/health`` and ``/metrics``: the fleet's view (nodes, SMG, the head)."""

from __future__ import annotations

import asyncio
import json
import logging
import time

import aiohttp
from aiohttp import web

from . import metrics as metrics_page
from .metrics import HeadMetrics
from .nodes import NodeMonitor
from .sessions import SessionMap
from .smg import Smg

log = logging.getLogger("superfluid.fleet")

QOS_HEADER = "x-superfluid-qos"
EXTENSION = "superfluid"
HOP_BY_HOP = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailers",
              "transfer-encoding", "upgrade", "host", "content-length", "content-encoding", "date", "server"}
SMG_WAIT_S = 15.0  # how long a request waits for a restarting SMG before its one retry
DONE = b"data: [DONE]"


def error_body(message: str, code: str, type_: str = "server_error", param: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error(status: int, message: str, code: str, type_: str = "server_error", param: str | None = None,
          headers: dict | None = None) -> web.Response:
    return web.json_response(error_body(message, code, type_, param), status=status, headers=headers)


def carry_class(raw: bytes, header: str | None) -> bytes:
    """The body with the header's class moved into ``superfluid.qos``, unless the body names one
    (or is not a JSON object: then the node's or SMG's 400 says what is wrong with it)."""
    if header is None:
        return raw
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return raw
    if not isinstance(body, dict):
        return raw
    ext = body.get(EXTENSION)
    if ext is None:
        body[EXTENSION] = {"qos": header}
    elif isinstance(ext, dict) and "qos" not in ext:
        ext["qos"] = header
    else:
        return raw
    return json.dumps(body).encode()


def parses(raw: bytes) -> bool:
    try:
        json.loads(raw)
        return True
    except (ValueError, UnicodeDecodeError):
        return False


def body_class(raw: bytes) -> str | None:
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return None
    ext = body.get(EXTENSION) if isinstance(body, dict) else None
    return ext.get("qos") if isinstance(ext, dict) else None


def body_model(raw: bytes) -> str | None:
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return None
    model = body.get("model") if isinstance(body, dict) else None
    return model if isinstance(model, str) else None


def forward_headers(request: web.Request) -> dict[str, str]:
    return {k: v for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP}


def relay_headers(resp: aiohttp.ClientResponse) -> dict[str, str]:
    return {k: v for k, v in resp.headers.items() if k.lower() not in HOP_BY_HOP}


class Unreachable(Exception):
    """The upstream (SMG or a node) could not be reached, or failed before answering."""


class FleetApp:
    def __init__(self, smg: Smg, monitor: NodeMonitor, head: HeadMetrics, policy: str):
        self.smg = smg
        self.monitor = monitor
        self.head = head
        self.policy = policy
        self.sessions = SessionMap(monitor)
        self.http: aiohttp.ClientSession | None = None
        self.started = int(time.time())
        self._restarts_seen = 0

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
        r.add_post("/v1/sessions", self.session_create)
        r.add_get("/v1/sessions", self.session_list)
        r.add_route("*", "/v1/sessions/{sid}{tail:(/.*)?}", self.session_call)
        r.add_route("*", "/{tail:.*}", self.to_smg)  # what SMG answers (its 404 for unknown routes)
        app.on_startup.append(self._open)
        app.on_cleanup.append(self._close)
        return app

    async def _open(self, app) -> None:
        self.http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=5),
                                          auto_decompress=False)

    async def _close(self, app) -> None:
        if self.http is not None:
            await self.http.close()

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
    async def _relay(self, request: web.Request, url: str, raw: bytes | None,
                     headers: dict[str, str]) -> web.StreamResponse:
        """One upstream call relayed to the client. Raises :class:`Unreachable` if it fails
        before the client got anything (so the caller may retry)."""
        try:
            upstream = await self.http.request(request.method, url, data=raw, headers=headers,
                                               params=request.query)
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            raise Unreachable(f"{type(exc).__name__}: {exc}") from None
        async with upstream:
            if not upstream.content_type == "text/event-stream":
                try:
                    body = await upstream.read()
                except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                    raise Unreachable(f"{type(exc).__name__}: {exc}") from None
                return web.Response(status=upstream.status, body=body, headers=relay_headers(upstream))
            out = web.StreamResponse(status=upstream.status, headers=relay_headers(upstream))
            await out.prepare(request)
            tail = b""
            problem = None
            while True:
                try:
                    chunk = await upstream.content.readany()
                except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                    problem = f"the upstream stream broke: {type(exc).__name__}: {exc}"
                    break
                if not chunk:
                    break
                try:
                    await out.write(chunk)
                except (ConnectionError, aiohttp.ClientConnectionResetError):
                    return out  # the client left: leaving this block closes the upstream too
                tail = (tail + chunk)[-64:]
            if DONE not in tail:
                problem = problem or "the upstream stream ended without [DONE]"
                self.head.errors.labels("stream_cut").inc()
                log.warning("%s %s: %s; ending it with an error event", request.method, request.path, problem)
                event = error_body(f"The fleet lost this stream: {problem}", "upstream_stream_cut")
                try:
                    await out.write(b"\n\ndata: " + json.dumps(event).encode() + b"\n\n" + DONE + b"\n\n")
                except (ConnectionError, aiohttp.ClientConnectionResetError):
                    return out
            await out.write_eof()
            return out

    async def _via_smg(self, request: web.Request, raw: bytes | None) -> web.StreamResponse:
        url = self.smg.base + request.path
        headers = forward_headers(request)
        if not self.smg.ready.is_set():  # SMG restarting, or not yet routing to its nodes
            await self.smg.wait_ready(SMG_WAIT_S)
        try:
            return await self._relay(request, url, raw, headers)
        except Unreachable as exc:
            why = str(exc)
        self.head.errors.labels("smg_unreachable").inc()
        self.smg.unreachable(why)
        log.warning("%s %s: SMG unreachable (%s); retrying once when it is back", request.method, request.path, why)
        if await self.smg.wait_ready(SMG_WAIT_S):
            try:
                resp = await self._relay(request, url, raw, headers)
                self.head.errors.labels("retried").inc()
                return resp
            except Unreachable as exc:
                why = str(exc)
        return error(503, f"The fleet's router (SMG) is unavailable: {why}; retry shortly", "router_unavailable",
                     headers={"Retry-After": "1"})

    # ---- OpenAI routes --------------------------------------------------------------------
    async def openai(self, request: web.Request) -> web.StreamResponse:
        raw = carry_class(await request.read(), request.headers.get(QOS_HEADER))
        if not parses(raw):  # SMG would answer with its own parser's 400: give the node's, as
            return await self._direct(request, raw, None)  # a single server answers it
        down = self._all_down(body_model(raw))
        return down if down is not None else await self._via_smg(request, raw)

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
            return await self._relay(request, node.url + request.path, raw, forward_headers(request))
        except Unreachable as exc:
            return self._node_down(node.url, str(exc))

    async def embeddings(self, request: web.Request) -> web.StreamResponse:
        """SMG re-serializes embeddings bodies without unknown fields and drops the header, so a
        request that names a class (header or body) goes straight to a node, unchanged: the
        node answers it exactly as it would a direct request."""
        raw = await request.read()
        down = self._all_down(body_model(raw))
        if down is not None:
            return down
        if request.headers.get(QOS_HEADER) is None and body_class(raw) is None and parses(raw):
            return await self._via_smg(request, raw)
        return await self._direct(request, raw, body_model(raw))

    async def models(self, request: web.Request) -> web.StreamResponse:
        try:
            return await self._relay(request, self.smg.base + "/v1/models", None, forward_headers(request))
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
    def _node_down(self, url: str, why: str | None, sid: str | None = None) -> web.Response:
        self.head.errors.labels("node_unavailable").inc()
        what = f"session {sid} is held by node {url}" if sid else f"node {url}"
        return error(503, f"{what}, which is unavailable ({why or 'not healthy'}); it answers again once "
                     f"the node is back", "node_unavailable", param="session_id" if sid else None,
                     headers={"Retry-After": "2"})

    async def session_create(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        model = body_model(raw)
        node = self.sessions.place(model)
        if node is None and model is not None and model not in self.monitor.models():
            node = self.sessions.place(None)  # the node answers the 404 for an unknown model
        if node is None:
            return error(503, "no healthy node" + (f" serves model {model!r}" if model else ""),
                         "no_healthy_node", headers={"Retry-After": "2"})
        try:
            resp = await self._relay(request, node.url + "/v1/sessions", raw, forward_headers(request))
        except Unreachable as exc:
            return self._node_down(node.url, str(exc))
        if resp.status == 201 and isinstance(resp, web.Response) and resp.body is not None:
            try:
                sid = json.loads(resp.body)["id"]
            except (ValueError, KeyError, TypeError):
                sid = None
            if isinstance(sid, str):
                self.sessions.remember(sid, node.url)
                self.head.sessions.labels(node.url).inc()
                log.info("session %s: on node %s", sid, node.url)
        return resp

    async def session_list(self, request: web.Request) -> web.Response:
        headers = forward_headers(request)

        async def one(url: str):
            try:
                async with self.http.get(url + "/v1/sessions", headers=headers,
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
                async with self.http.get(f"{node.url}/v1/sessions/{sid}", headers=forward_headers(request),
                                         timeout=aiohttp.ClientTimeout(total=5)) as resp:
                    if resp.status == 200:
                        self.sessions.remember(sid, node.url)
                        return node.url
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
                continue
        return None

    async def session_call(self, request: web.Request) -> web.StreamResponse:
        sid = request.match_info["sid"]
        url = self.sessions.node_of(sid) or await self._find(request, sid)
        if url is None:
            return error(404, f"No session with id {sid!r}", "session_not_found", "invalid_request_error",
                         "session_id")
        node = self.monitor.nodes.get(url)
        if node is None or not node.healthy:
            return self._node_down(url, node.last_error if node else "no longer listed", sid)
        raw = await request.read() if request.can_read_body else None
        try:
            resp = await self._relay(request, url + request.path, raw, forward_headers(request))
        except Unreachable as exc:
            return self._node_down(url, str(exc), sid)
        if request.method == "DELETE" and request.match_info["tail"] == "" and resp.status == 200:
            self.sessions.forget(sid)
            self.head.sessions.labels(url).dec()
        return resp

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
        for url, node in self.monitor.nodes.items():
            self.head.node_healthy.labels(url).set(1 if node.healthy else 0)
        self.head.smg_up.set(1 if self.smg.up else 0)
        if self.smg.restarts > self._restarts_seen:
            self.head.smg_restarts.inc(self.smg.restarts - self._restarts_seen)
            self._restarts_seen = self.smg.restarts

        async def page(url: str):
            try:
                async with self.http.get(url + "/metrics", timeout=aiohttp.ClientTimeout(total=3)) as resp:
                    return url, (await resp.text()) if resp.status == 200 else None
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
                return url, None

        pages = await asyncio.gather(*(page(n.url) for n in self.monitor.healthy()))
        texts = {url: text for url, text in pages if text}
        body = metrics_page.render(self.head, texts, await self.smg.metrics_text())
        return web.Response(body=body, content_type="text/plain", charset="utf-8")
