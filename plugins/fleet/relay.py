"""One upstream call (to SMG or straight to a node) relayed to the client, byte for byte, with
the one guarantee the head adds to streams: a stream that ends without ``data: [DONE]``, or
breaks, ends with an SSE error event and ``[DONE]``, so a client never waits on a dead upstream.
A call that fails before the client got anything raises :class:`Unreachable`, so the caller
may retry it.

A node answers a stream's headers (and its role chunk) as soon as it queues the request, long
before the request starts. So the head holds a stream back until its first token (or its
finish): a node that dies while the request still waits in its queue has then given the client
nothing, and :class:`NotStarted` lets the caller send it elsewhere. Once a token reached the
client the stream cannot move (the text would repeat), and it ends with the error event."""

from __future__ import annotations

import asyncio
import json
import logging

import aiohttp
from aiohttp import web

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

    async def call(self, request: web.Request, url: str, raw: bytes | None,
                   headers: dict[str, str], completion: bool = True) -> web.StreamResponse:
        """One upstream call relayed to the client. Raises :class:`Unreachable` if it fails
        before the client got anything (so the caller may retry). ``completion``: the stream is
        a generation's (held until its first token, ended with [DONE]); else (a node's /events)
        it is relayed as it comes."""
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
            held = await self._hold(upstream) if completion else b""
            out = web.StreamResponse(status=upstream.status, headers=relay_headers(upstream))
            await out.prepare(request)
            if held:
                await out.write(held)
            tail = held[-64:]
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
            if completion and DONE not in tail:
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

    async def _hold(self, upstream: aiohttp.ClientResponse) -> bytes:
        """What a stream sent up to and including its first token (see the module's docstring);
        raises :class:`NotStarted` if it broke, ended or reported an error before one."""
        node = upstream.headers.get("x-smg-routed-worker-id")
        held, scanned = b"", 0
        while len(held) < HOLD_LIMIT:
            try:
                chunk = await upstream.content.readany()
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
