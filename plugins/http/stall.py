"""A streamed reply whose client stops reading is cancelled, not decoded for nobody.

A client that stops reading without closing (a frozen tab, a process stopped under a debugger, a
proxy that never drains) fills the kernel's socket buffers, then the transport's 64 KiB, and then
``resp.write`` waits. Left to itself, Linux grows a socket's send buffer up to 4 MiB
(``tcp_wmem``), some 20,000 tokens of SSE: enough to hold a whole reply, so nothing would ever
wait, and 200 such clients would hold 800 MiB of kernel memory. A stream's socket therefore gets a
fixed send buffer (``STREAM_SNDBUF``, 128 KiB as Linux doubles it: several hundred deltas), far
more than any token rate needs. Past it the daemon's transport holds at most ``STREAM_BUFFER_CAP``
before a write waits for the client. Meanwhile its lane keeps decoding into the request's event queue: the
daemon's memory grows with every token and a lane is held until ``max_tokens``. So a write that
waits longer than ``--stream-stall-timeout`` seconds ends the request: the connection is closed,
the lane is cancelled like a disconnected client's (its KV freed at the next step) and a warning
names the request. What a stream can hold in the daemon is then bounded by the tokens its lane
makes in that time. A slow reader that keeps taking bytes resets the clock at every write that
completes, so it is served however slowly it reads, as long as no single write waits that long."""

from __future__ import annotations

import asyncio
import logging
import socket

from aiohttp import web

log = logging.getLogger("superfluid.http")

STREAM_SNDBUF = 64 * 1024  # bytes; the kernel doubles it for its bookkeeping
STREAM_BUFFER_CAP = 256 * 1024  # bytes a stream may hold unsent in the daemon's transport


async def _drained(transport) -> None:
    """Wait until the transport's unsent bytes are under half the cap. aiohttp's write waits once
    the transport has paused it (at 64 KiB); this bound does not rest on that. (It was added when
    some stalled replies in the chaos suite's full slow-readers run ended 200; the cause was the
    scenario's client, which read 128 KiB into its own buffer: docs/reliability.md.)"""
    while not transport.is_closing() and transport.get_write_buffer_size() > STREAM_BUFFER_CAP // 2:
        await asyncio.sleep(0.05)


class ClientStalled(ConnectionResetError):
    """The client took nothing for the stall timeout; handled like a client that went away."""


class StallGuard:
    """Writes a stream's bytes with a deadline on each write."""

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s

    @staticmethod
    def cap(request: web.Request) -> None:
        """Fix the stream's socket send buffer (see the module's doc), before its first byte."""
        transport = request.transport
        sock = transport.get_extra_info("socket") if transport is not None else None
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, STREAM_SNDBUF)
            except OSError:  # a platform that refuses it keeps its own buffer
                pass

    async def write(self, request: web.Request, resp: web.StreamResponse, data: bytes) -> None:
        transport = request.transport
        if transport is not None and transport.get_write_buffer_size() > STREAM_BUFFER_CAP:
            await self._within(request, _drained(transport))
        await self._within(request, resp.write(data))

    async def finish(self, request: web.Request, resp: web.StreamResponse) -> None:
        await self._within(request, resp.write_eof())

    async def _within(self, request: web.Request, writing) -> None:
        try:
            async with asyncio.timeout(self.timeout_s):  # a timer, not a task: cheap per token
                await writing
        except TimeoutError:
            log.warning("%s %s from %s: the client read nothing for %.0f s (--stream-stall-timeout); "
                        "stream closed and its lanes cancelled", request.method, request.path,
                        request.remote, self.timeout_s)
            if request.transport is not None:
                request.transport.abort()  # a stalled socket would never flush a graceful close
            raise ClientStalled(f"the client read nothing for {self.timeout_s:.0f} s") from None
