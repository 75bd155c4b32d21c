"""A node the head has just marked unhealthy, whose packets are dropped (a partition, not a
death: no RST, no FIN, the upstream connection simply goes silent), must not leave a stream
waiting on it: a stream that had started there ends at once with an error event and
``[DONE]``; one that had not (held back until its first token, or still waiting for its
response to begin) is handed back to the caller as :class:`NotStarted`, so it can go to another
node. Streams on other nodes are not touched.

Found by the chaos scenario ``fleet_partition`` (tools/chaos/scenarios/fleet_partition.py):
before, such streams hung until the partition healed, or SMG's TCP connection to the node timed
out (about 45 s)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from types import SimpleNamespace

import aiohttp
from aiohttp import web

from superfluid.plugins.fleet.metrics import HeadMetrics
from superfluid.plugins.fleet.proxy import FleetApp
from superfluid.plugins.fleet.relay import NotStarted, Relay

NODE_X, NODE_Y = "http://10.9.9.2:8080", "http://10.9.9.6:8080"
ROLE = b'data: {"choices": [{"index": 0, "delta": {"role": "assistant"}}]}\n\n'
TOKEN = b'data: {"choices": [{"index": 0, "delta": {"content": "Once"}}]}\n\n'
DONE = b"data: [DONE]\n\n"


async def _upstream(request: web.Request) -> web.StreamResponse:
    """A fake node behind SMG: ``?mode=`` token (a token, then silence), held (only the role
    chunk, then silence), silent (no response at all), whole (a token, then [DONE] after a while)."""
    mode, node = request.query["mode"], request.query.get("node", NODE_X)
    if mode == "silent":
        await asyncio.sleep(3600)
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "x-smg-routed-worker-id": node})
    await resp.prepare(request)
    await resp.write(ROLE)
    if mode in ("token", "whole"):
        await resp.write(TOKEN)
    if mode == "whole":
        await asyncio.sleep(1.5)
        await resp.write(TOKEN + DONE)
        return resp
    await asyncio.sleep(3600)
    return resp


async def _serve(app: web.Application, runners: list[web.AppRunner]) -> str:
    """Serve ``app`` on a free loopback port (its runner added to ``runners``); its base URL."""
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=0.5)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    runners.append(runner)
    return f"http://127.0.0.1:{runner.addresses[0][1]}"


class Harness:
    """A fake upstream, and a head-like app relaying every POST to it through :class:`Relay`;
    ``async with Harness() as h``: ``h.base`` the head, ``h.http`` a client session."""

    def __init__(self):
        self.relay = Relay(HeadMetrics())
        self.not_started: list[NotStarted] = []
        self.runners: list[web.AppRunner] = []

    async def __aenter__(self) -> "Harness":
        up = web.Application()
        up.router.add_post("/v1/chat/completions", _upstream)
        self.up_base = await _serve(up, self.runners)
        head = web.Application()
        head.router.add_post("/v1/chat/completions", self._head)
        await self.relay.open()
        self.base = await _serve(head, self.runners)
        self.http = aiohttp.ClientSession()
        return self

    async def _head(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        try:
            return await self.relay.call(request, self.up_base + "/v1/chat/completions", raw,
                                         {"Content-Type": "application/json"})
        except NotStarted as exc:
            self.not_started.append(exc)
            return web.json_response({"moved": True, "node": exc.node}, status=503)

    async def __aexit__(self, *exc) -> None:
        await self.http.close()
        await self.relay.close()
        for r in self.runners:
            await r.cleanup()


async def _until(check, timeout: float = 2.0) -> None:
    """Wait until ``check()`` is true (a relay's state reached), polling every 20 ms."""
    deadline = time.monotonic() + timeout
    while not check() and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    assert check(), "the state the test waits for never came"


async def _read(http: aiohttp.ClientSession, base: str, mode: str, node: str = NODE_X,
                got_token: asyncio.Event | None = None) -> tuple[int, list[bytes], float]:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    async with http.post(f"{base}/v1/chat/completions?mode={mode}&node={node}", json=body,
                         timeout=aiohttp.ClientTimeout(total=20)) as r:
        events = []
        async for line in r.content:
            if line.startswith(b"data:"):
                events.append(line.strip())
                if got_token is not None and b'"content"' in line:
                    got_token.set()
        return r.status, events, time.monotonic()


def _run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


def _run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


def test_a_started_stream_on_a_lost_node_ends_with_an_error_event_at_once():
    async def main():
        async with Harness() as h:
            started = asyncio.Event()
            task = asyncio.create_task(_read(h.http, h.base, "token", got_token=started))
            await asyncio.wait_for(started.wait(), 5)
            lost_at = time.monotonic()
            assert h.relay.node_lost(NODE_X, "/health did not answer within 2 s") == 1
            status, events, ended = await task
            assert status == 200
            assert ended - lost_at < 2.0
            assert events[-1] == b"data: [DONE]"
            err = json.loads(events[-2][5:])["error"]
            assert err["code"] == "node_unavailable" and NODE_X in err["message"]
            assert "did not answer" in err["message"]
            assert h.relay.flows == set()  # nothing left registered
    _run(main())


def test_a_held_stream_on_a_lost_node_is_handed_back_to_go_elsewhere():
    async def main():
        async with Harness() as h:
            task = asyncio.create_task(_read(h.http, h.base, "held"))
            # the head holds it: its role chunk came, no token
            await _until(lambda: any(f.upstream is not None for f in h.relay.flows))
            assert h.relay.node_lost(NODE_X, "cut off") == 1
            status, events, _ = await task
            assert status == 503 and len(h.not_started) == 1
            assert h.not_started[0].node == NODE_X and "cut off" in str(h.not_started[0])
    _run(main())


def test_a_stream_still_waiting_for_its_response_is_handed_back_when_a_node_is_lost():
    async def main():
        async with Harness() as h:
            task = asyncio.create_task(_read(h.http, h.base, "silent"))
            await _until(lambda: h.relay.flows)
            await asyncio.sleep(0.2)
            # SMG has not said which node it picked: it may be the lost one
            assert h.relay.node_lost(NODE_X, "cut off") == 1
            status, _, _ = await task
            assert status == 503 and h.not_started[0].node == NODE_X
    _run(main())


def test_streams_on_other_nodes_are_left_alone():
    async def main():
        async with Harness() as h:
            started = asyncio.Event()
            task = asyncio.create_task(_read(h.http, h.base, "whole", node=NODE_Y, got_token=started))
            await asyncio.wait_for(started.wait(), 5)
            assert h.relay.node_lost(NODE_X, "cut off") == 0
            status, events, _ = await task
            assert status == 200 and events[-1] == b"data: [DONE]"
            assert not any(b'"error"' in e for e in events)
    _run(main())


def test_a_non_streamed_call_is_not_interrupted_by_another_nodes_loss():
    """Whole answers say which node holds them only when they end: the relay alone never cuts
    one because some node was lost (its caller may send it again: see the tests below)."""
    async def main():
        async with Harness() as h:
            body = {"model": "m", "messages": [], "stream": False}
            task = asyncio.create_task(h.http.post(f"{h.base}/v1/chat/completions?mode=silent", json=body,
                                                   timeout=aiohttp.ClientTimeout(total=1.5)))
            await _until(lambda: h.relay.flows)
            assert h.relay.node_lost(NODE_X, "cut off") == 0
            with contextlib.suppress(asyncio.TimeoutError):
                await task  # still waiting, as it should
            assert not h.not_started
    _run(main())


def test_the_head_ends_the_streams_of_each_node_that_leaves_the_healthy_set():
    monitor = SimpleNamespace(nodes={NODE_X: SimpleNamespace(last_error="/health did not answer within 2 s"),
                                     NODE_Y: SimpleNamespace(last_error=None)})
    app = FleetApp(SimpleNamespace(workers={}), monitor, HeadMetrics(), "round_robin")
    lost: list[tuple[str, str]] = []
    app.relay.node_lost = lambda url, why, wholes: lost.append((url, why, wholes)) or 0
    app.nodes_changed([NODE_X, NODE_Y])
    app.nodes_changed([NODE_Y])
    assert lost == [(NODE_X, "/health did not answer within 2 s", True)]  # SMG's load unknown: resend
    app.nodes_changed([NODE_X, NODE_Y])  # back: nothing to end
    assert len(lost) == 1


class _FakeSmg:
    """What FleetApp asks of SMG: its base URL (the fake upstream), ready, where it routes."""

    def __init__(self, base: str, loads: dict[str, int]):
        self.base = base
        self.ready = asyncio.Event()
        self.ready.set()
        self.workers = {url: {"url": url, "load": n, "is_healthy": True, "status": "ready"} for url, n in loads.items()}
        self.up = True

    def routable(self, url: str) -> bool:
        return False  # the lost node is out of SMG's list at once

    def unreachable(self, error: str) -> None:
        pass

    async def wait_ready(self, timeout: float) -> bool:
        return True


@contextlib.asynccontextmanager
async def _fleet(loads: dict[str, int]):
    """A FleetApp in front of a fake SMG whose first whole answer never comes (it went to the node
    that was cut off) and whose later ones come at once; SMG's last /workers load per node is
    ``loads``. Yields the app, its base URL and the times SMG was called."""
    calls: list[float] = []

    async def upstream(request: web.Request) -> web.Response:
        calls.append(time.monotonic())
        if len(calls) == 1:
            await asyncio.sleep(3600)
        return web.json_response({"choices": [{"message": {"content": "hi"}}]},
                                 headers={"x-smg-routed-worker-id": NODE_Y})

    runners: list[web.AppRunner] = []
    try:
        up = web.Application()
        up.router.add_post("/v1/chat/completions", upstream)
        smg = _FakeSmg(await _serve(up, runners), loads)
        monitor = SimpleNamespace(nodes={NODE_X: SimpleNamespace(last_error="cut off"),
                                         NODE_Y: SimpleNamespace(last_error=None)},
                                  models=lambda: {}, healthy=lambda model=None: [])
        fleet = FleetApp(smg, monitor, HeadMetrics(), "round_robin")
        base = await _serve(fleet.make_app(), runners)
        fleet.nodes_changed([NODE_X, NODE_Y])
        yield fleet, base, calls
    finally:
        for r in reversed(runners):
            await r.cleanup()


async def _whole_chat_then_lose_x(fleet, base: str, calls: list, total_s: float):
    """A whole chat through the head; once SMG has it, node X leaves the healthy set. The
    response (None if the client gave up after ``total_s``) and when X was lost."""
    async with aiohttp.ClientSession() as http:
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        task = asyncio.create_task(http.post(base + "/v1/chat/completions", json=body,
                                             timeout=aiohttp.ClientTimeout(total=total_s)))
        await _until(lambda: calls)
        lost_at = time.monotonic()
        fleet.nodes_changed([NODE_Y])
        try:
            resp = await task
        except asyncio.TimeoutError:
            return None, lost_at
        return (resp.status, await resp.json()), lost_at


def test_a_whole_answer_that_may_be_on_a_lost_node_is_sent_again_and_the_first_answer_wins():
    """A non-streamed request says where it went only when it is answered: when a node SMG had
    requests on is lost, each whole answer still waiting is sent again (SMG no longer routes to
    that node), and the first of the two to answer is the client's."""
    async def main():
        async with _fleet({NODE_X: 1, NODE_Y: 0}) as (fleet, base, calls):
            answer, lost_at = await _whole_chat_then_lose_x(fleet, base, calls, 20)
            assert answer is not None and answer[0] == 200 and answer[1]["choices"]
            assert time.monotonic() - lost_at < 2.0 and len(calls) == 2
    _run(main())


def test_no_whole_answer_is_sent_again_when_smg_had_nothing_on_the_lost_node():
    async def main():
        async with _fleet({NODE_X: 0, NODE_Y: 1}) as (fleet, base, calls):
            answer, _ = await _whole_chat_then_lose_x(fleet, base, calls, 1.5)
            assert answer is None and len(calls) == 1  # left where it is
    _run(main())
