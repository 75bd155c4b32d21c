"""superfluid_http_auth_seconds: what authentication and the key limits cost a request, observed
once per request (a whole reply, a stream, a 401, a 429), never for /health, and with the key
limiter's admit and release counted in the request whose task calls them. An in-process aiohttp
app with the real middlewares and a route that uses the limiter as the OpenAI routes do; no
model, and no upper bound on any time."""

from __future__ import annotations

import asyncio
import time
import types

from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from superfluid.plugins.http.errors import json_errors
from superfluid.plugins.http.info.metrics import METRICS
from superfluid.plugins.http.keys import auth
from superfluid.plugins.http.keys.limits import HEADERS, KeyLimits
from superfluid.plugins.http.keys.policy import hash_secret, parse_policy

POLICY = f"""[keys.free]
sha256 = "{hash_secret("sk-free")}"

[keys.narrow]
sha256 = "{hash_secret("sk-narrow")}"
lanes = 1
requests-per-minute = 600
"""
CONFIG = {"http-qos-header": True, "http-default-qos": "agent"}


def observed() -> tuple[float, float]:
    """(count, sum) of the histogram so far (the process-wide METRICS the middleware feeds)."""
    count = total = 0.0
    for family in METRICS.auth_seconds.collect():
        for sample in family.samples:
            if sample.name.endswith("_count"):
                count = sample.value
            elif sample.name.endswith("_sum"):
                total = sample.value
    return count, total


def app_with(seen: list) -> web.Application:
    limits = KeyLimits()
    held: list = []  # a ticket kept open, so the narrow key's one lane is busy

    async def generate(request: web.Request) -> web.StreamResponse:
        seen.append(auth._CURRENT.get() is request[auth.COST])  # the limiter's calls find this request
        key = auth.request_key(request)
        auth.note_class(request, auth.applied_class(request, CONFIG))
        request[HEADERS] = (limits, key)
        ticket = limits.admit(key, 5)  # may raise the 429
        if request.query.get("hold"):
            held.append(ticket)
            return web.json_response({"held": True})
        try:
            if request.query.get("stream"):
                resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
                await resp.prepare(request)
                await resp.write(b"data: {}\n\n")
                await resp.write_eof()
                return resp
            return web.json_response({"ok": True})
        finally:
            ticket.end(3)

    app = web.Application(middlewares=[json_errors, auth.middleware(types.SimpleNamespace(
        current=parse_policy(POLICY, "p.toml")), CONFIG)])
    app.on_response_prepare.append(auth.qos_header(CONFIG))
    app.router.add_post("/gen", generate)
    async def health(request):  # a handler is a coroutine (aiohttp deprecates bare functions)
        return web.json_response({"status": "ok"})

    app.router.add_get("/health", health)
    return app


def bearer(secret: str) -> dict:
    return {"Authorization": f"Bearer {secret}"}


def test_door_time_counts_only_inside_a_request():
    """A limiter call wrapped in door_time adds its time to the cost of the request whose context
    runs it; outside a request (or once it is over) the block still runs and nothing is counted."""
    limits = KeyLimits()

    def limiter_call() -> None:
        limits.admit(None, 1).end(0)
        time.sleep(0.002)  # a block long enough to see in the sum

    before = observed()
    with auth.door_time():  # outside a request: the block runs, nothing is counted
        limiter_call()
    assert observed() == before

    cost = auth._Cost()
    token = auth._CURRENT.set(cost)  # what the middleware does around a handler
    try:
        with auth.door_time():
            limiter_call()
    finally:
        auth._CURRENT.reset(token)
    assert cost.seconds >= 0.002
    spent = cost.seconds
    with auth.door_time():  # the request is over: its cost no longer grows
        limiter_call()
    assert cost.seconds == spent and observed() == before


def test_each_request_is_observed_once():
    seen: list = []

    async def go():
        client = TestClient(TestServer(app_with(seen)))
        await client.start_server()
        try:
            steps = []

            async def step(name, method, path, **kw):
                before = observed()
                async with client.request(method, path, **kw) as resp:
                    await resp.read()
                    status = resp.status
                    retry = resp.headers.get("Retry-After")
                await asyncio.sleep(0)
                after = observed()
                steps.append((name, status, after[0] - before[0], after[1] >= before[1], retry))

            await step("whole", "POST", "/gen", headers=bearer("sk-free"))
            await step("stream", "POST", "/gen?stream=1", headers=bearer("sk-free"))
            await step("unknown key", "POST", "/gen", headers=bearer("sk-nobody"))
            await step("no key", "POST", "/gen")
            await step("hold a lane", "POST", "/gen?hold=1", headers=bearer("sk-narrow"))
            await step("lanes full", "POST", "/gen", headers=bearer("sk-narrow"))
            await step("health", "GET", "/health")
            return steps
        finally:
            await client.close()

    steps = asyncio.run(go())
    by_name = {name: (status, count, grew, retry) for name, status, count, grew, retry in steps}
    assert by_name["whole"][:3] == (200, 1, True)
    assert by_name["stream"][:3] == (200, 1, True)
    assert by_name["unknown key"][:2] == (401, 1)
    assert by_name["no key"][:2] == (401, 1)
    assert by_name["hold a lane"][:2] == (200, 1)
    assert by_name["lanes full"][:2] == (429, 1) and by_name["lanes full"][3] is not None
    assert by_name["health"][:2] == (200, 0)
    assert seen and all(seen)
    assert auth._CURRENT.get() is None
