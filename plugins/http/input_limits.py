"""Limits on what a client may send, and the guard that keeps slow clients from holding the server.

Body size, body read time and the counts of messages / stop strings / tools are checked where a
body is read (:func:`.body.read_body`, from :data:`LIMITS` on the application). What aiohttp
does not bound itself is the time a client may take to send a request's *head*: its keep-alive
timer closes an idle connection, but nothing limits a head that trickles in a byte at a time.

:class:`GuardedHandler` (the per-connection protocol, installed by :func:`guard`) adds that:

* a deadline for the head, ``header_timeout`` seconds from the first byte of a request (and from
  the connection's opening, so a connection that sends nothing is closed too): a client that
  has not finished a head by then gets a 408 JSON body and the connection is closed;
* a cap on the head's total size (the parser only bounds each line, and the number of lines):
  more than ``max_header_bytes`` before the head is complete, or a complete head that is larger,
  is a 431 JSON body, then close;
* parse errors (a line longer than the limit, too many headers, malformed HTTP) answer an
  OpenAI-style JSON body instead of aiohttp's text (431 for header sizes, else 400).

* a cap on open connections (``max_connections``): one more is answered 503 with
  ``Retry-After`` and closed at once.

Together with the body timeout (``read_body``), the keep-alive timeout and aiohttp's lingering
time, every phase of a connection has a deadline, so a slowloris holds a connection for at most
``header_timeout`` seconds (a trickled body: ``body_timeout`` plus aiohttp's 10 s lingering), and
the connection cap bounds how many it can hold at once. The handler relies on a few of aiohttp's ``RequestHandler``
internals (``_messages``, ``_request_in_progress``, ``_keepalive_handle``); the server tests in
tests/server/test_input_limits.py fail if an aiohttp upgrade changes them."""

from __future__ import annotations

import json
import logging
from http import HTTPStatus

import attrs
from aiohttp import web
from aiohttp.http_exceptions import BadHttpMessage, LineTooLong
from aiohttp.web_protocol import RequestHandler

from .options import OPTIONS, STOP_CAP, TOOLS_CAP  # noqa: F401  (the caps: imported from here too)

log = logging.getLogger("superfluid.http")


@attrs.frozen
class Limits:
    max_body_bytes: int = 16 << 20
    max_header_bytes: int = 16 << 10
    max_messages: int = 2048
    max_stop: int = 16
    max_tools: int = 128
    header_timeout: float = 10.0
    body_timeout: float = 60.0
    keepalive_timeout: float = 15.0
    max_connections: int = 1024

    @classmethod
    def from_config(cls, config) -> "Limits":
        """The limits the options set (``config``: the Config, a dict, or ``OPTIONS.of(config)``)."""
        o = OPTIONS.of(config if config is not None else {})
        return cls(max_body_bytes=int(o.max_body_mb) << 20, max_header_bytes=int(o.max_header_kb) << 10,
                   max_messages=o.max_messages, max_stop=o.max_stop, max_tools=o.max_tools,
                   header_timeout=float(o.header_timeout), body_timeout=float(o.body_timeout),
                   keepalive_timeout=float(o.keepalive_timeout), max_connections=o.max_connections)

    def server_kwargs(self) -> dict:
        """What the AppRunner passes to every connection's :class:`GuardedHandler`."""
        return {"keepalive_timeout": self.keepalive_timeout, "max_line_size": self.max_header_bytes,
                "max_field_size": self.max_header_bytes, "header_timeout": self.header_timeout,
                "max_header_bytes": self.max_header_bytes, "max_connections": self.max_connections}


LIMITS = web.AppKey("superfluid_limits", Limits)


def error_bytes(status: int, message: str, code: str, retry_after: int | None = None) -> bytes:
    """A complete HTTP/1.1 response with an OpenAI-style JSON body that closes the connection."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    body = json.dumps({"error": {"message": message, "type": kind, "param": None, "code": code}}).encode()
    head = (f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n"
            + (f"Retry-After: {retry_after}\r\n" if retry_after is not None else "") + "\r\n")
    return head.encode("ascii") + body


def error_response(status: int, message: str, code: str) -> web.Response:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return web.json_response({"error": {"message": message, "type": kind, "param": None, "code": code}},
                             status=status)


def head_size(request) -> int:
    """The bytes of a request's head as sent: request line, headers, blank line."""
    line = len(request.method) + len(request.raw_path) + len(" HTTP/1.1\r\n") + 1
    return line + sum(len(k) + len(v) + 4 for k, v in request.raw_headers) + 2


class GuardedHandler(RequestHandler):
    """aiohttp's per-connection protocol with a deadline and a size cap on each request head."""

    __slots__ = ("_header_timeout", "_max_header_bytes", "_max_connections", "_head_handle", "_head_bytes",
                 "_last_body")

    def __init__(self, manager, *, header_timeout: float = 10.0, max_header_bytes: int = 16 << 10,
                 max_connections: int = 1024, **kwargs):
        super().__init__(manager, **kwargs)
        self._header_timeout = header_timeout
        self._max_header_bytes = max_header_bytes
        self._max_connections = max_connections
        self._head_handle = None
        self._head_bytes = 0
        self._last_body = None  # the previous request's payload: bytes after its head are its body

    # ---- the head deadline -------------------------------------------------------------------

    def _awaiting_head(self) -> bool:
        """Bytes arriving now belong to the next request's head (not a body, not a queued head)."""
        return (not self._request_in_progress and not self._messages and not self._force_close
                and not self._close and (self._last_body is None or self._last_body.is_eof()))

    def _arm(self) -> None:
        self._head_bytes = 0
        self._head_handle = self._loop.call_later(self._header_timeout, self._head_expired)

    def _disarm(self) -> None:
        if self._head_handle is not None:
            self._head_handle.cancel()
            self._head_handle = None
        self._head_bytes = 0

    def _head_expired(self) -> None:
        self._head_handle = None
        if self._awaiting_head():
            self._refuse(408, f"the request head was not received within {self._header_timeout:g} s "
                              "(--header-timeout)", "request_timeout")

    def _refuse(self, status: int, message: str, code: str, retry_after: int | None = None) -> None:
        log.info("closing a connection from %s: %s", self.peername, message)
        if self.transport is not None:
            self.transport.write(error_bytes(status, message, code, retry_after))
        self.force_close()

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        if self._manager is not None and len(self._manager.connections) > self._max_connections:
            self._refuse(503, f"the server holds {self._max_connections} connections (--max-connections); "
                              "retry later", "too_many_connections", retry_after=1)
            return
        self._arm()  # the first head is due within header_timeout of the connection's opening

    def connection_lost(self, exc) -> None:
        self._disarm()
        self._last_body = None
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        head = bool(data) and self._awaiting_head()
        if head:
            if self._head_handle is None:  # a new head after an idle keep-alive: its own deadline
                if self._keepalive_handle is not None:
                    self._keepalive_handle.cancel()
                    self._keepalive_handle = None
                self._arm()
            self._head_bytes += len(data)
        super().data_received(data)
        if self._messages:  # bytes after this head are its body until the parser ends it
            self._last_body = self._messages[-1][1]
        if not head:
            return
        if self._messages or self._request_in_progress:  # the head is complete (or failed to parse)
            self._disarm()
        elif self._head_bytes > self._max_header_bytes:
            self._disarm()
            self._refuse(431, f"the request head is larger than {self._max_header_bytes >> 10} KiB "
                              "(--max-header-kb)", "request_header_too_large")

    async def _handle_request(self, request, start_time, request_handler):
        self._disarm()
        if head_size(request) > self._max_header_bytes:  # a head that arrived whole, in one read
            request_handler = self._head_too_large
        return await super()._handle_request(request, start_time, request_handler)

    async def _head_too_large(self, request) -> web.StreamResponse:
        resp = error_response(431, f"the request head is larger than {self._max_header_bytes >> 10} KiB "
                                   "(--max-header-kb)", "request_header_too_large")
        resp.force_close()
        return resp

    # ---- JSON bodies for what the parser refuses ----------------------------------------------

    def handle_error(self, request, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        super().handle_error(request, status, exc, message)  # logs; raises if a response began
        code, text = "internal_error", "internal server error"
        if isinstance(exc, LineTooLong) or (isinstance(exc, BadHttpMessage) and "too many headers" in str(exc).lower()):
            status, code = 431, "request_header_too_large"
            text = (f"a request line or header is too large or there are too many headers "
                    f"(--max-header-kb {self._max_header_bytes >> 10}): {getattr(exc, 'message', exc)}")
        elif status < 500:
            code, text = "bad_http_request", f"malformed HTTP request: {getattr(exc, 'message', exc)}"
        resp = error_response(status, text, code)
        resp.force_close()
        return resp


class GuardedServer(web.Server):
    """aiohttp's Server, making :class:`GuardedHandler` connections."""

    def __call__(self) -> RequestHandler:
        return GuardedHandler(self, loop=self._loop, **self._kwargs)


def guard(runner: web.BaseRunner) -> None:
    """Make ``runner``'s server (after ``setup()``, before any site starts) hand out
    :class:`GuardedHandler` connections. Its kwargs must include :meth:`Limits.server_kwargs`."""
    server = runner.server
    assert server is not None and type(server) is web.Server, server
    server.__class__ = GuardedServer  # only __call__ differs
