"""The /events hub (plugins/http/events/hub.py) on fake schedulers: what the tick thread pays, the
bounded ring, the snapshot schema of docs/api.md, coalescing for a slow reader, a stalled reader
dropped without holding up the others, and the reader cap. No model, no server (the real server
is tests/server/test_events.py)."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from types import SimpleNamespace

import pytest

from superfluid.core import qos
from superfluid.core.errors import InvalidRequest
from superfluid.core.stats import TickStats
from superfluid.plugins.http.events import hub as ev
from superfluid.plugins.http.events.key_tally import TeeMetrics
from superfluid.plugins.http.events.routes import parse_query

from .fakes import submit

LANE_KEYS = {"id", "state", "qos", "request_id", "prompt_tokens", "cached_tokens", "prefilled_tokens",
             "generated_tokens", "max_tokens", "tokens_per_s", "preemptions"}
TICK_KEYS = {"seq", "at", "seconds", "target_s", "prefill_tokens", "decode_tokens", "lanes", "stopped_early"}


def _stats(model="m", first=(), preempted=0) -> TickStats:
    return TickStats(model=model, seconds=0.02, prefill_tokens=5, decode_tokens=3, prefill_budget=512,
                     decode_grant=4, lanes_busy=3, max_lanes=4, queue_depth=1, stopped_early=False,
                     kv_used=10, kv_capacity=100, first_tokens=list(first), finished=[], queue_by_class={},
                     lanes_by_class={}, preempted=preempted, target_s=0.05)


class FakeLoop:
    """A scheduler that answers ``snapshot()`` with a fixed /slots view (counts its reads)."""

    def __init__(self, view: dict):
        self.view, self.reads, self.fail = view, 0, False

    def snapshot(self) -> dict:
        self.reads += 1
        if self.fail:
            raise RuntimeError("the model went away")
        return self.view


def _slots_view() -> dict:
    return {"model": "m", "queued": 3, "ticks": 7, "kv_used": 25, "kv_capacity": 100, "kv_cached": 40,
            "pinned_prefixes": 0, "parked_bytes": 4096, "host_cache_bytes": 1 << 20, "host_cache_entries": 2,
            "pressure": "warning", "costs": {},
            "slots": [{"id": 0, "state": "free", "cached_tokens": 12},
                      {"id": 1, "state": "decoding", "request_id": "r1", "qos": "interactive", "prompt_tokens": 20,
                       "cached_tokens": 25, "generated_tokens": 6, "max_tokens": 50, "prefilled_tokens": 20,
                       "preemptions": 1, "prefill_tokens_per_s": 900.0, "decode_tokens_per_s": 31.5},
                      {"id": 2, "state": "prefilling", "request_id": "r2", "qos": "agent", "prompt_tokens": 300,
                       "cached_tokens": 100, "generated_tokens": 0, "max_tokens": None, "prefilled_tokens": 100,
                       "preemptions": 0, "prefill_tokens_per_s": 450.0}],
            "queue": [{"request_id": "q1", "qos": "background", "waited_s": 1.5, "parked": False},
                      {"request_id": "q2", "qos": "background", "waited_s": 4.0, "parked": True},
                      {"request_id": "q3", "qos": "agent", "waited_s": 0.2, "parked": False}]}


def _hub(view=None, **kw) -> tuple[ev.EventHub, FakeLoop]:
    loop = FakeLoop(view or _slots_view())
    daemon = SimpleNamespace(models={"m": SimpleNamespace(loop=loop)})
    return ev.EventHub(daemon, **kw), loop


def test_the_tick_thread_pays_microseconds():
    hub, _ = _hub()
    stats = _stats(first=[("agent", 0.1)])
    n = 20000
    start = time.perf_counter()
    for _ in range(n):
        hub.superfluid_tick_done("m", stats)
    per_tick = (time.perf_counter() - start) / n
    print(f"tick_done: {per_tick * 1e6:.2f} us per tick")
    assert per_tick < 20e-6  # ~1 us on a laptop; generous for a loaded CI core
    assert len(hub.ring) == ev.TICK_RING  # bounded: the oldest dropped, never growing


def test_snapshot_schema_from_a_slots_view():
    hub, loop = _hub()
    for i in range(3):
        hub.superfluid_tick_done("m", _stats(first=[("interactive", 0.1 * (i + 1))], preempted=1))
    hub.superfluid_lane_finished("m", None)
    data = hub.build(None, {})
    m = data["models"]["m"]
    assert loop.reads == 1 and "keys" not in data  # no key policy: no keys
    assert [lane["id"] for lane in m["lanes"]] == [0, 1, 2]
    assert all(set(lane) == LANE_KEYS for lane in m["lanes"])
    free, decoding, prefilling = m["lanes"]
    assert free["state"] == "free" and free["qos"] is None and free["cached_tokens"] == 12
    assert decoding["tokens_per_s"] == 31.5 and decoding["preemptions"] == 1  # the decode rate first
    assert prefilling["tokens_per_s"] == 450.0 and prefilling["max_tokens"] is None
    assert set(m["queues"]) == set(qos.CLASSES)  # every class, empty ones included
    assert m["queues"]["background"] == {"count": 2, "oldest_wait_s": 4.0, "parked": 1}
    assert m["queues"]["interactive"]["count"] == 0
    assert m["kv"] == {"used": 25, "capacity": 100, "occupancy": 0.25, "cached_tokens": 40, "host_bytes": 1 << 20,
                       "host_entries": 2, "parked_bytes": 4096, "pinned_prefixes": 0}
    assert m["pressure"] == "warning"
    assert [t["seq"] for t in m["ticks"]] == [1, 2, 3] and all(set(t) == TICK_KEYS for t in m["ticks"])
    assert m["ttft"]["interactive"] == {"count": 3, "p50": 0.2, "p95": 0.3, "p99": 0.3}
    assert m["ttft"]["background"] == {"count": 0, "p50": None, "p95": None, "p99": None}
    assert m["preemptions_total"] == 3 and m["requests_total"] == 1
    json.dumps(data, allow_nan=False)  # one line of JSON


def test_ticks_are_the_ones_since_the_previous_snapshot_at_most_200():
    hub, _ = _hub()
    since: dict = {}
    for _ in range(250):
        hub.superfluid_tick_done("m", _stats())
    first = hub.build(None, since)["models"]["m"]["ticks"]
    assert len(first) == ev.MAX_TICKS and first[-1]["seq"] == 250 and first[0]["seq"] == 51
    assert hub.build(None, since)["models"]["m"]["ticks"] == []  # nothing new
    hub.superfluid_tick_done("m", _stats())
    assert [t["seq"] for t in hub.build(None, since)["models"]["m"]["ticks"]] == [251]


def test_a_slow_reader_gets_the_newest_snapshot_with_what_it_missed_counted():
    async def go():
        hub, _ = _hub()
        reader = hub.open(500, None)  # the channel's first snapshot waits in its mailbox
        channel = reader.channel
        for _ in range(3):
            hub.superfluid_tick_done("m", _stats())
            reader.offer(channel.build())  # the reader takes none of them
        assert reader.coalesced == 3
        data = json.loads(reader.take().decode().split("data: ", 1)[1])
        assert data["coalesced"] == 3 and data["seq"] == 4  # the newest, counting what it missed
        assert [t["seq"] for t in data["models"]["m"]["ticks"]] == [1, 2, 3]  # carried: no hole in the timeline
        assert reader.take() is None
        reader.offer(channel.build())
        again = json.loads(reader.take().decode().split("data: ", 1)[1])
        assert again["coalesced"] == 0 and again["seq"] == 5 and again["models"]["m"]["ticks"] == []
        hub.close(reader)
        assert hub.readers == 0 and not hub.channels
    asyncio.run(go())


def test_one_build_per_interval_for_every_reader_and_a_stalled_one_is_dropped():
    async def go():
        hub, loop = _hub(stall_s=0.3)
        got: list[list[bytes]] = [[] for _ in range(5)]
        stall = asyncio.Event()

        def writer(i):
            async def write(data: bytes):
                got[i].append(data)
            return write

        async def stalled(data: bytes):
            await stall.wait()  # a socket that never drains

        readers = [hub.open(100, None) for _ in range(5)]
        stuck = hub.open(100, None)
        tasks = [asyncio.create_task(hub.stream(r, writer(i))) for i, r in enumerate(readers)]
        aborted = []
        stuck_task = asyncio.create_task(hub.stream(stuck, stalled, lambda: aborted.append(True)))
        await asyncio.sleep(1.05)
        assert stuck_task.done() and aborted and hub.dropped == 1  # dropped after 0.3 s of no progress
        builds = loop.reads
        assert 5 <= builds <= 13  # ~one per 100 ms for all six readers, not one per reader
        for i in range(5):
            snaps = [json.loads(g.decode().split("data: ", 1)[1]) for g in got[i]]
            assert len(snaps) >= builds - 2, "a stalled reader held up the others"
            assert [s["seq"] for s in snaps] == sorted({s["seq"] for s in snaps})
            assert all(s["coalesced"] == 0 for s in snaps)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        assert hub.readers == 0
        await asyncio.sleep(0.15)
        assert not hub.channels and loop.reads <= builds + 2  # no readers: no more building
    asyncio.run(go())


def test_reader_cap_is_a_503():
    async def go():
        hub, _ = _hub(max_readers=2)
        a, b = hub.open(500, None), hub.open(1000, "m")
        with pytest.raises(ev.TooManyReaders) as refused:
            hub.open(500, None)
        assert refused.value.status == 503 and refused.value.code == "too_many_readers"
        hub.close(a)
        hub.close(hub.open(500, None))
        hub.close(b)
        assert hub.readers == 0
        await hub.shutdown()
    asyncio.run(go())


def test_ping_when_nothing_else_is_sent_and_shutdown_ends_streams():
    async def go():
        hub, loop = _hub(ping_s=0.05)
        reader = hub.open(100, None)
        reader.take()  # the first snapshot taken; the next ones cannot be built
        loop.fail = True
        sent: list[bytes] = []

        async def write(data):
            sent.append(data)
        task = asyncio.create_task(hub.stream(reader, write))
        await asyncio.sleep(0.35)
        assert sent and all(s == b"event: ping\ndata: {}\n\n" for s in sent)
        await hub.shutdown()
        await asyncio.wait_for(task, 1)
        assert hub.readers == 0
    asyncio.run(go())


def test_keys_with_a_policy():
    policy = SimpleNamespace(current=SimpleNamespace(keys={"alice": None, "bob": None}))
    hub, _ = _hub(policy=policy)
    tee = TeeMetrics(SimpleNamespace(key_admitted=lambda k: None, key_finished=lambda k, p, c: None,
                                        key_rejected=lambda k, r: None, key_busy=lambda k, n: None), hub.keys)
    tee.key_admitted("alice")
    tee.key_finished("alice", 10, 5)
    tee.key_rejected("bob", "lanes")
    tee.key_busy("alice", 1)  # passed through to the metrics
    assert hub.build(None, {})["keys"] == {"alice": {"requests": 1, "tokens": 15, "rejections": 0},
                                           "bob": {"requests": 0, "tokens": 0, "rejections": 1}}
    assert json.loads(hub.hello(500).decode().split("data: ", 1)[1])["keys"] is True


def test_query():
    assert parse_query({}) == (500, None)
    assert parse_query({"interval_ms": "100", "model": "m", "key": "x"}) == (100, "m")
    assert parse_query({"interval_ms": "149"}) == (100, None) and parse_query({"interval_ms": "150"}) == (200, None)
    assert parse_query({"interval_ms": "5000"}) == (5000, None)
    for bad in ({"interval_ms": "99"}, {"interval_ms": "5001"}, {"interval_ms": "fast"}, {"since": "1"}):
        with pytest.raises(InvalidRequest):
            parse_query(bad)


def test_a_real_scheduler_snapshot(make, plugin_manager):
    """The schema from a real ModelLoop on a fake engine, its ticks heard through the hook."""
    loop, engine = make(start=False, max_batch=2)
    hub = ev.EventHub(SimpleNamespace(models={loop.name: SimpleNamespace(loop=loop)}))
    name = f"events-{uuid.uuid4().hex[:8]}"
    plugin_manager.register(hub, name)
    try:
        submit(loop, [1, 2, 3, 4, 5], 20, qos="interactive")
        submit(loop, [7, 8, 9], 20, qos="background")
        submit(loop, [11, 12], 20, qos="background")
        for _ in range(3):
            loop.step()
        m = hub.build(None, {})["models"][loop.name]
    finally:
        plugin_manager.unregister(hub)
    assert len(m["lanes"]) == 2 and all(set(lane) == LANE_KEYS for lane in m["lanes"])
    assert {lane["state"] for lane in m["lanes"]} <= {"prefilling", "decoding"}
    assert m["queues"]["background"]["count"] == 1  # two lanes run, one waits
    assert [t["seq"] for t in m["ticks"]] == [1, 2, 3]
    assert m["ttft"]["interactive"]["count"] == 1
    assert sum(lane["generated_tokens"] for lane in m["lanes"]) > 0
    assert all(t["target_s"] and t["target_s"] > 0 for t in m["ticks"])  # each plan's target, from the tick's stats
