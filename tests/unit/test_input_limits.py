"""Input limits (issue 17), the parts that need no model: the loop's --max-queue refusal, the body
checks of body.read_body, the options, and the per-connection guard of plugins/http/input_limits.py
against an in-process aiohttp server on a loopback port."""

from __future__ import annotations

import asyncio
import json
import time
from types import SimpleNamespace

import attrs
import pytest
from aiohttp import web

from superfluid.core.config import Schema, build_config, core_options
from superfluid.core.errors import InvalidRequest, QueueFull, RequestTimeout
from superfluid.core.plugins import make_plugin_manager
from superfluid.plugins.http.body import read_body
from superfluid.plugins.http.errors import json_errors
from superfluid.plugins.http.prepare import params
from superfluid.plugins.http.openai.protocol import CompletionRequest
from superfluid.plugins.http.typed import parse
from superfluid.plugins.http.input_limits import LIMITS, Limits, guard

from .fakes import WAIT, FakeEngine, submit


# ---- --max-queue: the loop refuses, per class -------------------------------------------------------

def test_a_full_class_queue_refuses_with_429_and_retry_after(make):
    loop, engine = make(FakeEngine(max_lanes=1), max_batch=1, max_queue=1)
    engine.block()
    _, running = submit(loop, [1, 2], 3)
    assert engine.holding.wait(WAIT)
    _, queued = submit(loop, [3, 4], 3)
    with pytest.raises(QueueFull) as info:
        submit(loop, [5, 6], 3)
    err = info.value
    assert err.status == 429 and err.code == "queue_full" and err.headers["Retry-After"] == "1"
    assert "--max-queue" in err.message
    assert loop.snapshot()["queued"] == 1            # the refused request left nothing behind
    _, other_class = submit(loop, [7, 8], 3, qos="background")  # another class has its own bound
    assert loop.snapshot()["queued"] == 2
    engine.unblock()
    for sink in (running, queued, other_class):
        assert sink.wait().finish_reason == "length"
    _, again = submit(loop, [9], 2)                  # room again once the queue drained
    assert again.wait().finish_reason == "length"
    assert engine.errors == []


def test_the_default_queue_bound_is_generous(make):
    loop, engine = make(FakeEngine(max_lanes=1), max_batch=1)
    assert loop.settings.max_queue == 256
    engine.block()
    sinks = [submit(loop, [i + 1], 1)[1] for i in range(40)]
    engine.unblock()
    assert all(s.wait().finish_reason == "length" for s in sinks)


# ---- the options ------------------------------------------------------------------------------------

def _config(flags: dict):
    schema = Schema()
    for opt in core_options():
        schema.add(opt)
    make_plugin_manager().hook.superfluid_add_config(schema=schema)
    return build_config(schema, {}, flags)


def test_defaults_and_flags():
    config = _config({})
    limits = Limits.from_config(config)
    assert limits == Limits()
    assert (limits.max_body_bytes, limits.max_header_bytes) == (16 << 20, 16 << 10)
    assert (limits.max_messages, limits.max_stop, limits.max_tools) == (2048, 16, 128)
    assert (limits.header_timeout, limits.body_timeout, limits.keepalive_timeout) == (10.0, 60.0, 15.0)
    assert limits.max_connections == 1024
    assert config.models[0]["max-queue"] == 256
    limits = Limits.from_config(_config({"max_body_mb": 1, "max_header_kb": 4, "header_timeout": 2.5}))
    assert (limits.max_body_bytes, limits.max_header_bytes, limits.header_timeout) == (1 << 20, 4 << 10, 2.5)
    kw = limits.server_kwargs()
    assert kw["max_field_size"] == kw["max_line_size"] == 4 << 10 and kw["keepalive_timeout"] == 15.0


@pytest.mark.parametrize("flag,value", [("max_queue", 0), ("max_stop", 65), ("max_tools", 129),
                                        ("header_timeout", 0.0), ("max_body_mb", 0)])
def test_out_of_range_flags_are_refused(flag, value):
    from superfluid.core.errors import ConfigError
    with pytest.raises(ConfigError, match=flag.replace("_", "-")):
        _config({flag: value})


# ---- read_body ----------------------------------------------------------------------------------------

class FakeRequest:
    def __init__(self, data: bytes, limits: Limits | None, *, length: int | None = None, delay: float = 0.0):
        self.data, self.delay = data, delay
        self.content_length = len(data) if length is None else length
        self.config_dict = {LIMITS: limits} if limits is not None else {}

    async def read(self) -> bytes:
        await asyncio.sleep(self.delay)
        return self.data


def read(data, limits=Limits(), **kw):
    return asyncio.run(read_body(FakeRequest(data, limits, **kw)))


def test_a_body_over_the_limit_is_413_before_it_is_read():
    with pytest.raises(InvalidRequest) as info:
        read(b"{}", Limits(max_body_bytes=1 << 20), length=(1 << 20) + 1)
    assert info.value.status == 413 and info.value.code == "request_too_large"
    assert "--max-body-mb" in info.value.message


def test_a_slow_body_is_408():
    with pytest.raises(RequestTimeout) as info:
        read(b"{}", Limits(body_timeout=0.05), delay=5)
    assert info.value.status == 408 and info.value.code == "request_timeout"


@pytest.mark.parametrize("field,most", [("messages", 3), ("stop", 2), ("tools", 2)])
def test_too_many_entries_is_400_naming_the_field(field, most):
    limits = Limits(max_messages=3, max_stop=2, max_tools=2)
    assert read(json.dumps({field: [{}] * most}).encode(), limits) == {field: [{}] * most}
    with pytest.raises(InvalidRequest) as info:
        read(json.dumps({field: [{}] * (most + 1)}).encode(), limits)
    assert info.value.status == 400 and info.value.param == field
    assert info.value.code == "array_above_max_length"


def test_no_limits_without_an_application():
    assert read(json.dumps({"messages": [1] * 5000}).encode(), None) == {"messages": [1] * 5000}


def test_stop_strings_hard_cap():
    def stops(n):
        return params.stop_strings(parse(CompletionRequest, {"prompt": "x", "stop": ["a"] * n}))
    assert len(stops(64)) == 64
    with pytest.raises(InvalidRequest):
        stops(65)


# ---- the connection guard: an in-process server with short limits -------------------------------------

LIMITED = Limits(max_body_bytes=1 << 20, max_header_bytes=2 << 10, header_timeout=0.6, body_timeout=0.6,
                 keepalive_timeout=5.0)


async def _echo(request):
    body = await read_body(request)
    return web.json_response({"n": len(body)})


async def _hello(request):
    return web.json_response({"ok": True})


class Guarded:
    """An aiohttp app behind the guard on a free loopback port (started in a test's event loop)."""

    def __init__(self, limits: Limits = LIMITED):
        self.limits = limits

    async def __aenter__(self):
        app = web.Application(middlewares=[json_errors], client_max_size=self.limits.max_body_bytes)
        app[LIMITS] = self.limits
        app.router.add_post("/echo", _echo)
        app.router.add_get("/hello", _hello)
        self.runner = web.AppRunner(app, access_log=None, **self.limits.server_kwargs())
        await self.runner.setup()
        guard(self.runner)
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.port = self.runner.addresses[0][1]
        return self

    async def __aexit__(self, *exc):
        await self.runner.cleanup()

    async def open(self):
        return await asyncio.open_connection("127.0.0.1", self.port)

    async def get(self, path="/hello", extra=b""):
        r, w = await self.open()
        w.write(b"GET " + path.encode() + b" HTTP/1.1\r\nHost: x\r\n" + extra + b"Connection: close\r\n\r\n")
        await w.drain()
        data = await asyncio.wait_for(r.read(), 5)
        w.close()
        return data


def status_and_body(raw: bytes) -> tuple[int, dict]:
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


async def _closed_within(reader, seconds: float) -> bytes:
    """What the server sent before it closed the connection (fails if it stays open)."""
    return await asyncio.wait_for(reader.read(), seconds)


def run(coro):
    return asyncio.run(coro)


def test_a_half_sent_head_gets_408_and_is_closed():
    async def main():
        async with Guarded() as srv:
            r, w = await srv.open()
            w.write(b"POST /echo HTTP/1.1\r\nHost: x\r\n")
            t0 = time.monotonic()
            raw = await _closed_within(r, 3)
            assert 0.5 <= time.monotonic() - t0 < 2.5
            status, body = status_and_body(raw)
            assert status == 408 and body["error"]["code"] == "request_timeout"
            assert status_and_body(await srv.get())[0] == 200    # others are served meanwhile
    run(main())


def test_a_head_trickled_a_byte_at_a_time_is_cut_at_the_deadline():
    async def main():
        async with Guarded() as srv:
            r, w = await srv.open()

            async def trickle():  # would take 6 s to finish the head
                try:
                    for byte in b"GET /hello HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 100 + b"\r\n\r\n":
                        w.write(bytes([byte]))
                        await w.drain()
                        await asyncio.sleep(0.05)
                except ConnectionError:
                    pass

            sender = asyncio.create_task(trickle())
            t0 = time.monotonic()
            try:
                raw = await _closed_within(r, 3)
            except ConnectionResetError:  # the close raced the bytes still arriving
                raw = b""
            assert time.monotonic() - t0 < 2.5
            assert raw == b"" or status_and_body(raw)[0] == 408
            sender.cancel()
            assert status_and_body(await srv.get())[0] == 200
    run(main())


def test_a_connection_that_sends_nothing_is_closed():
    async def main():
        async with Guarded() as srv:
            r, w = await srv.open()
            t0 = time.monotonic()
            raw = await _closed_within(r, 3)
            assert time.monotonic() - t0 < 2.5
            assert status_and_body(raw)[0] == 408
    run(main())


def test_keep_alive_connections_serve_requests_and_each_head_gets_its_own_deadline():
    async def main():
        async with Guarded() as srv:
            r, w = await srv.open()
            for i in range(3):
                if i:  # idle between requests longer than the head timeout: the keep-alive timeout rules
                    await asyncio.sleep(0.9)
                w.write(b"GET /hello HTTP/1.1\r\nHost: x\r\n\r\n")
                await w.drain()
                head = await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), 3)
                assert head.startswith(b"HTTP/1.1 200")
                length = int(next(l for l in head.split(b"\r\n") if l.lower().startswith(b"content-length"))
                             .split(b":")[1])
                await r.readexactly(length)
            w.close()
    run(main())


def test_an_idle_keep_alive_connection_is_closed_after_the_keepalive_timeout():
    async def main():
        async with Guarded(attrs.evolve(LIMITED, keepalive_timeout=0.5, header_timeout=5.0)) as srv:
            r, w = await srv.open()
            w.write(b"GET /hello HTTP/1.1\r\nHost: x\r\n\r\n")
            await w.drain()
            head = await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), 3)
            assert head.startswith(b"HTTP/1.1 200")
            t0 = time.monotonic()
            await _closed_within(r, 3)
            assert time.monotonic() - t0 < 2.0
    run(main())


def test_a_head_over_the_size_limit_is_431_json():
    async def main():
        async with Guarded() as srv:
            one_long = await srv.get(extra=b"X-Big: " + b"a" * (3 << 10) + b"\r\n")
            status, body = status_and_body(one_long)
            assert status == 431 and body["error"]["code"] == "request_header_too_large"
            many = b"".join(b"X-H%d: %s\r\n" % (i, b"b" * 500) for i in range(8))  # 4 KiB in 8 lines
            status, body = status_and_body(await srv.get(extra=many))
            assert status == 431 and body["error"]["code"] == "request_header_too_large"
            small = b"".join(b"X-H%d: %s\r\n" % (i, b"b" * 100) for i in range(8))
            assert status_and_body(await srv.get(extra=small))[0] == 200
    run(main())


def test_too_many_headers_is_431_and_a_bad_header_400():
    async def main():
        async with Guarded() as srv:
            many = b"".join(b"X%d: 1\r\n" % i for i in range(130))  # small, but more than 128 lines
            status, body = status_and_body(await srv.get(extra=many))
            assert status == 431 and body["error"]["code"] == "request_header_too_large"
            status, body = status_and_body(await srv.get(extra=b"Bad Name: x\r\n"))
            assert status == 400 and body["error"]["code"] == "bad_http_request"
    run(main())


def test_malformed_http_is_a_json_400():
    async def main():
        async with Guarded() as srv:
            r, w = await srv.open()
            w.write(b"NOT HTTP AT ALL\r\n\r\n")
            status, body = status_and_body(await _closed_within(r, 3))
            assert status == 400 and body["error"]["code"] == "bad_http_request"
    run(main())


def test_bodies_over_the_limit_and_too_slow():
    async def main():
        async with Guarded() as srv:
            r, w = await srv.open()
            w.write(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    b"Content-Length: %d\r\n\r\n" % ((1 << 20) + 1))
            await w.drain()
            head = await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), 3)
            assert head.startswith(b"HTTP/1.1 413")
            w.close()
            # chunked: no Content-Length, aiohttp's client_max_size answers, as JSON
            r, w = await srv.open()
            chunk = b"a" * (256 << 10)
            w.write(b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n")
            try:
                for _ in range(5):
                    w.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                    await w.drain()
                w.write(b"0\r\n\r\n")
                await w.drain()
            except ConnectionError:
                pass
            status, body = status_and_body(await _closed_within(r, 5))
            assert status == 413 and body["error"]["code"] == "request_too_large"
            # a body that trickles: 408 after the body timeout
            r, w = await srv.open()
            w.write(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    b"Content-Length: 100\r\n\r\n{\"a\":")
            await w.drain()
            t0 = time.monotonic()
            head = await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), 3)
            assert head.startswith(b"HTTP/1.1 408") and time.monotonic() - t0 < 2.5
            w.close()
    run(main())


def test_connections_over_the_cap_get_503_and_are_closed():
    async def main():
        async with Guarded(attrs.evolve(LIMITED, max_connections=2, header_timeout=5.0)) as srv:
            held = [await srv.open() for _ in range(2)]
            await asyncio.sleep(0.1)
            r, w = await srv.open()
            raw = await _closed_within(r, 3)
            status, body = status_and_body(raw)
            assert status == 503 and body["error"]["code"] == "too_many_connections"
            assert b"Retry-After: 1" in raw
            for _, hw in held:
                hw.close()
            await asyncio.sleep(0.2)
            assert status_and_body(await srv.get())[0] == 200   # room again
    run(main())


def test_the_guard_wraps_only_a_plain_server():
    runner = SimpleNamespace(server=object())
    with pytest.raises(AssertionError):
        guard(runner)

