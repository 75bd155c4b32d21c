"""One upstream call (to SMG or straight to a node) relayed to the client, byte for byte, with
the one guarantee the head adds to streams: a stream that ends without ``data: [DONE]``, or
breaks, ends with an SSE error event and ``[DONE]``, so a client never waits on a dead upstream.
A call that fails before the client got anything raises :class:`Unreachable`, so the caller
may retry it.

A node answers a stream's headers (and its role chunk) as soon as it queues the request, long
before the request starts. So the head holds a stream back until its first token (or its
finish): a node that dies while the request still waits in its queue has then given the client
nothing, and :class:`NotStarted` lets the caller send it elsewhere. Once a token reached the
client the stream cannot move (the text would repeat), and it ends with the error event.

A node cut off from the network (its packets dropped: no RST, no FIN) leaves its connections
silent rather than broken, so nothing above would end its streams until the partition heals or
TCP gives up (SMG's connection to the node: about 45 s). The head knows sooner: its health polls
mark the node unhealthy within about five seconds, and then :meth:`Relay.node_lost` ends every
stream relayed from that node (SMG's ``x-smg-routed-worker-id``, or the node a direct call went
to): a started one with an error event (code ``node_unavailable``), a held one as
:class:`NotStarted`; so is a stream whose response has not begun yet (SMG has not said where it
went, and a healthy node answers a stream's headers as soon as it queues it). A whole
(non-streamed) answer names its node only when it ends: the caller may pass a ``suspect`` future,
which :meth:`Relay.node_lost` sets (to the lost node's URL) while such a call still waits, so the
caller can send it again elsewhere (:meth:`.proxy.FleetApp._whole`); without one it is left to
SMG, which retries a request whose connection fails (about 45 s for a silent one) on another
node."""

from __future__ import annotations

import asyncio
import json
import logging

import aiohttp
from aiohttp import web

from .body import wants_stream
from .metrics import HeadMetrics

log = logging.getLogger("superfluid.fleet")

HOP_BY_HOP = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailers",
              "transfer-encoding", "upgrade", "host", "content-length", "content-encoding", "date", "server"}
DONE = b"data: [DONE]"


def error_body(message: str, code: str, type_: str = "server_error", param: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error(status: int, message: str, code: str, type_: str = "server_error", param: str | None = None,
          headers: dict | None = None) -> web.Response:
    return web.json_response(error_body(message, code, type_, param), status=status, headers=headers)


def forward_headers(request: web.Request) -> dict[str, str]:
    return {k: v for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP}


def relay_headers(resp: aiohttp.ClientResponse) -> dict[str, str]:
    return {k: v for k, v in resp.headers.items() if k.lower() not in HOP_BY_HOP}


class Unreachable(Exception):
    """The upstream (SMG or a node) could not be reached, or failed before answering."""


class NotStarted(Unreachable):
    """A stream failed before its first token: the client got nothing, so it may go elsewhere.
    ``node``: the node that held it (SMG's ``x-smg-routed-worker-id``), if known."""

    def __init__(self, why: str, node: str | None):
        super().__init__(why)
        self.node = node


class NodeLost(Exception):
    """The head marked this flow's node unhealthy (:meth:`Relay.node_lost`)."""


class Flow:
    """One upstream call in progress: the node that holds it (once known), whether it is a stream,
    and what :meth:`Relay.node_lost` needs to interrupt it."""

    __slots__ = ("node", "stream", "pending", "upstream", "lost", "suspect")

    def __init__(self, node: str | None, stream: bool, suspect: asyncio.Future | None = None):
        self.node, self.stream, self.suspect = node, stream, suspect
        self.pending: asyncio.Future | None = None  # the request, until its response begins
        self.upstream: aiohttp.ClientResponse | None = None
        self.lost: str | None = None  # why its node was lost

    def lose(self, url: str, why: str) -> None:
        self.lost = f"node {url} stopped answering ({why})"
        self.node = self.node or url
        if self.upstream is not None:
            self.upstream.content.set_exception(NodeLost(self.lost))  # wakes the pending read
        elif self.pending is not None:
            self.pending.cancel()


HOLD_LIMIT = 1 << 20  # a stream that sends this much before a token is relayed as it is


def started(events: bytes) -> tuple[bool, str | None]:
    """(whether these complete SSE events hold a token or a finish, the first error's message).
    A token: a choice with text, content, tool calls or a finish reason (chat or completions);
    an error event before one means the request never ran."""
    for line in events.split(b"\n"):
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            return True, None
        try:
            event = json.loads(data)
        except ValueError:
            continue
        if not isinstance(event, dict):
            continue
        if "error" in event:
            err = event["error"]
            return False, str(err.get("message") if isinstance(err, dict) else err)
        for choice in event.get("choices") or []:
            if not isinstance(choice, dict):
                continue
            delta = choice.get("delta") or {}
            if choice.get("finish_reason") or choice.get("text") or (
                    isinstance(delta, dict) and (delta.get("content") or delta.get("tool_calls"))):
                return True, None
    return False, None


class Relay:
    """The head's client session for upstream calls, and the relaying itself."""

    def __init__(self, head: HeadMetrics, ssl=None):
        self.head = head
        self.http: aiohttp.ClientSession | None = None
        self.ssl = ssl  # an SSLContext verifying https:// nodes (--ssl-cafile); None: the default
        self.flows: set[Flow] = set()  # the upstream calls in progress

    async def open(self) -> None:
        self.http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=5),
                                          connector=aiohttp.TCPConnector(ssl=self.ssl or True),
                                          auto_decompress=False)

    async def close(self) -> None:
        if self.http is not None:
            await self.http.close()

    def node_down(self, url: str, why: str | None, sid: str | None = None) -> web.Response:
        """503 ``node_unavailable`` naming the node (and the session it holds)."""
        self.head.errors.labels("node_unavailable").inc()
        what = f"session {sid} is held by node {url}" if sid else f"node {url}"
        return error(503, f"{what}, which is unavailable ({why or 'not healthy'}); it answers again once "
                     f"the node is back", "node_unavailable", param="session_id" if sid else None,
                     headers={"Retry-After": "2"})

    def held_by(self, url: str) -> int:
        """Calls in progress known to be on node ``url``."""
        return sum(1 for f in self.flows if f.node == url)

    def node_lost(self, url: str, why: str | None, wholes: bool = True) -> int:
        """The head marked node ``url`` unhealthy: end the streams it holds (see the module's
        docstring), and the streams whose response has not begun; with ``wholes``, tell each
        whole answer still waiting (its ``suspect``) that it may be there too. How many calls
        were interrupted or told."""
        hit = 0
        for flow in list(self.flows):
            if flow.lost is not None or flow.upstream is not None and flow.node != url:
                continue
            if flow.node == url or (flow.node is None and flow.stream):
                flow.lose(url, why or "not healthy")
                hit += 1
            elif wholes and flow.node is None and flow.suspect is not None and not flow.suspect.done():
                flow.suspect.set_result(url)
                hit += 1
        if hit:
            self.head.errors.labels("node_lost").inc(hit)
            log.warning("node %s unhealthy (%s): ending or resending the %d call(s) it may hold", url, why, hit)
        return hit

    async def call(self, request: web.Request, url: str, raw: bytes | None,
                   headers: dict[str, str], completion: bool = True, node: str | None = None,
                   suspect: asyncio.Future | None = None) -> web.StreamResponse:
        """One upstream call relayed to the client. Raises :class:`Unreachable` if it fails
        before the client got anything (so the caller may retry). ``completion``: the stream is
        a generation's (held until its first token, ended with [DONE]); else (a node's /events)
        it is relayed as it comes. ``node``: the node a direct call goes to (through SMG, the
        response names it). ``suspect``: see :meth:`node_lost`."""
        flow = Flow(node, completion and wants_stream(raw), suspect)
        self.flows.add(flow)
        try:
            return await self._call(flow, request, url, raw, headers, completion)
        finally:
            self.flows.discard(flow)

    async def _call(self, flow: Flow, request: web.Request, url: str, raw: bytes | None,
                    headers: dict[str, str], completion: bool) -> web.StreamResponse:
        flow.pending = asyncio.ensure_future(self.http.request(request.method, url, data=raw, headers=headers,
                                                               params=request.query))
        try:
            upstream = await flow.pending
        except asyncio.CancelledError:
            if flow.lost is None:
                raise  # the client left (or the head stops)
            raise NotStarted(f"{flow.lost} before its response began", flow.node) from None
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            raise Unreachable(f"{type(exc).__name__}: {exc}") from None
        flow.upstream, flow.pending = upstream, None
        flow.node = flow.node or upstream.headers.get("x-smg-routed-worker-id")
        if flow.lost is not None:  # lost while its headers were on their way
            upstream.content.set_exception(NodeLost(flow.lost))
        async with upstream:
            if not upstream.content_type == "text/event-stream":
                try:
                    body = await upstream.read()
                except NodeLost as exc:
                    raise Unreachable(str(exc)) from None
                except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                    raise Unreachable(f"{type(exc).__name__}: {exc}") from None
                return web.Response(status=upstream.status, body=body, headers=relay_headers(upstream))
            held = await self._hold(upstream, flow) if completion else b""
            out = web.StreamResponse(status=upstream.status, headers=relay_headers(upstream))
            await out.prepare(request)
            if held:
                await out.write(held)
            tail = held[-64:]
            problem = None
            while True:
                try:
                    chunk = await upstream.content.readany()
                except NodeLost as exc:
                    problem = str(exc)
                    break
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
            if completion and DONE not in tail:
                problem = problem or "the upstream stream ended without [DONE]"
                self.head.errors.labels("stream_cut").inc()
                log.warning("%s %s: %s; ending it with an error event", request.method, request.path, problem)
                event = error_body(f"The fleet lost this stream: {problem}",
                                   "node_unavailable" if flow.lost else "upstream_stream_cut")
                try:
                    await out.write(b"\n\ndata: " + json.dumps(event).encode() + b"\n\n" + DONE + b"\n\n")
                except (ConnectionError, aiohttp.ClientConnectionResetError):
                    return out
            try:
                await out.write_eof()
            except (ConnectionError, aiohttp.ClientConnectionResetError):
                pass  # the client left after the last byte
            return out

    async def _hold(self, upstream: aiohttp.ClientResponse, flow: Flow) -> bytes:
        """What a stream sent up to and including its first token (see the module's docstring);
        raises :class:`NotStarted` if it broke, ended or reported an error before one, or its
        node was lost."""
        node = flow.node
        held, scanned = b"", 0
        while len(held) < HOLD_LIMIT:
            try:
                chunk = await upstream.content.readany()
            except NodeLost as exc:
                raise NotStarted(f"{exc} before this stream's first token", node) from None
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                raise NotStarted(f"the stream broke before its first token: {type(exc).__name__}: {exc}", node) from None
            if not chunk:
                raise NotStarted("the stream ended before its first token", node)
            held += chunk
            end = held.rfind(b"\n\n")
            if end < scanned:
                continue
            ok, problem = started(held[scanned:end])
            scanned = end
            if problem is not None:
                raise NotStarted(f"the stream failed before its first token: {problem}", node)
            if ok:
                break
        return held
