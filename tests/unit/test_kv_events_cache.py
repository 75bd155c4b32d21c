"""The KV manager's cache events (``core.cache_events.CacheEvent``, on each tick's stats) follow what the
prefix cache holds through its whole life: a finished lane's KV kept, a cached prefix cut or
copied for reuse, evictions to the host tier (slot reuse, watermarks), OS pressure and a lost
engine. The check is the same everywhere: replaying every event reported so far gives exactly
what the cache holds. The loop runs on the fake engine with a prefix cache and parking
(``fakes.py``), stepped tick by tick (``stepped``)."""

from __future__ import annotations

from superfluid.core.cache_events import CacheEvent

from .fakes import drive, expected, prompt, run_stepped, step, submit


def replay(events: list[CacheEvent]) -> dict:
    """(medium, holder) -> tokens, after ``events`` in order."""
    held: dict = {}
    for ev in events:
        if ev.kind == "stored":
            held[(ev.medium, ev.holder)] = list(ev.tokens[:ev.length])
        elif ev.kind == "removed":
            held.pop((ev.medium, ev.holder), None)
        else:
            assert ev.kind == "cleared"
            for key in [k for k in held if ev.medium is None or k[0] == ev.medium]:
                del held[key]
    return {k: v for k, v in held.items() if v}


def actual(loop) -> dict:
    """What the cache holds now: each free slot's cached prefix, each host-tier entry, and each
    running lane's seed (the prefix it was given)."""
    kv = loop.scheduler.kv
    out = {("gpu", s): kv.cache.tokens(s) for s in kv.free if kv.cache.tokens(s)}
    out.update({("cpu", key): list(entry[0]) for key, entry in kv.host._entries.items()})
    return out


class Events:
    """Every cache event of the ticks run through it, and the check."""

    def __init__(self, loop):
        self.loop = loop
        self.all: list[CacheEvent] = []

    def add(self, stats_list) -> list[CacheEvent]:
        new = [ev for s in stats_list for ev in s.cache_events]
        self.all += new
        return new

    def run(self, engine, tokens, max_tokens) -> tuple[int, list[CacheEvent]]:
        _, lp, stats = run_stepped(self.loop, engine, tokens, max_tokens)
        return lp.slot, self.add(stats)

    def check(self) -> None:
        """Free slots and the host tier: exactly what they hold. A running lane's slot: at most
        the start of that lane's own tokens (the seed it was given), never an older cache."""
        held = replay(self.all)
        running = {("gpu", lane.slot): lane for lane in self.loop.scheduler.lanes}
        for key, lane in running.items():
            tokens = held.pop(key, [])
            assert tokens == lane.tokens[:len(tokens)], key
        assert held == actual(self.loop)


def test_a_finished_lane_is_stored_and_a_shared_prefix_is_kept(stepped):
    loop, engine, _, _ = stepped(max_batch=4, host_cache_bytes=1 << 20)
    ev = Events(loop)
    A = prompt(100, 80)
    slot, new = ev.run(engine, A, 3)
    stored = [e for e in new if e.kind == "stored"]
    assert {(e.medium, e.holder) for e in stored} == {("gpu", slot)}
    assert stored[0].tokens[:stored[0].length] == A                        # prefilled, while it ran
    assert stored[-1].tokens[:stored[-1].length] == A + expected(A, 3)[:2]  # at the end (the last token never fed)
    ev.check()
    # A longer prompt sharing A's prefix: the slot's cache is the seed (cut in place or copied).
    B = A[:60] + prompt(700, 40)
    slot_b, new = ev.run(engine, B, 2)
    assert any(e.kind == "stored" and e.holder == slot_b and e.tokens[:e.length][:60] == A[:60] for e in new)
    ev.check()


def test_evictions_move_prefixes_to_the_host_tier_and_os_pressure_clears_it(stepped):
    loop, engine, source, _ = stepped(max_batch=2, host_cache_bytes=1 << 20)
    ev = Events(loop)
    P = [prompt(100 * k, 80) for k in range(6)]
    for p in P[:2]:
        ev.run(engine, p, 1)
    ev.check()
    _, new = ev.run(engine, P[2], 1)                  # both slots cached: one is reused, its prefix parked
    assert [e.medium for e in new if e.kind == "stored"].count("cpu") == 1
    assert len(loop.scheduler.kv.host) == 1
    ev.check()
    source.value = "warning"
    _, sink = submit(loop, P[3], 2)
    ev.add([step(loop, engine)[1]])
    source.value = "ok"
    ev.add(drive(loop, engine, sink.done.is_set))
    assert any(e.kind == "cleared" and e.medium == "cpu" for e in ev.all)
    assert len(loop.scheduler.kv.host) == 0
    ev.check()


def test_watermark_eviction_is_reported(stepped):
    loop, engine, _, _ = stepped(max_batch=4, kv_capacity=400, pressure_high=0.85, pressure_low=0.70,
                                 host_cache_bytes=1 << 20)
    ev = Events(loop)
    for k in (1, 3, 5):
        ev.run(engine, prompt(100 * k, 90), 1)
    ev.check()
    _, new = ev.run(engine, prompt(700, 110), 4)       # 380 / 400 >= 85 %: evicts down to 70 %
    removed = [e for e in new if e.kind == "removed" and e.medium == "gpu"]
    assert len(removed) >= 2
    ev.check()


def test_a_lost_engine_clears_everything(stepped):
    loop, engine, _, _ = stepped(max_batch=2, host_cache_bytes=1 << 20)
    ev = Events(loop)
    for k in (1, 2, 3):
        ev.run(engine, prompt(100 * k, 80), 1)
    assert replay(ev.all)
    loop.scheduler.engine_lost()
    _, new = ev.run(engine, prompt(900, 70), 1)
    assert CacheEvent("cleared", None) in new
    assert new.index(CacheEvent("cleared", None)) < max(i for i, e in enumerate(new) if e.kind == "stored")
    ev.check()
    assert set(replay(ev.all)) == {("gpu", k[1]) for k in actual(loop)}


def test_a_preempted_lane_holds_nothing(stepped):
    loop, engine, _, _ = stepped(max_batch=1, host_cache_bytes=0)
    ev = Events(loop)
    A = prompt(100, 80)
    ev.run(engine, A, 1)
    _, sink = submit(loop, A[:70] + prompt(500, 30), 50, qos="background")
    ev.add([step(loop, engine)[1]])                    # seeded from A's cache, prefilling
    lane = loop.scheduler.lanes[0]
    assert replay(ev.all)[("gpu", lane.slot)][:70] == A[:70]
    slot = lane.slot
    loop.scheduler.preempt(lane)
    assert loop.scheduler.kv.cache_events[-1] == CacheEvent("removed", "gpu", slot)   # its KV is not offered
    assert ("gpu", slot) not in replay(ev.all + loop.scheduler.kv.cache_events)
    ev.add([step(loop, engine)[1]] if loop.busy() else [])
    ev.add(drive(loop, engine, sink.done.is_set))
    ev.check()


def test_a_lane_that_reuses_nothing_overwrites_a_cached_slot(stepped):
    loop, engine, _, _ = stepped(max_batch=1, host_cache_bytes=1 << 20)
    ev = Events(loop)
    ev.run(engine, prompt(100, 80), 1)
    _, sink = submit(loop, prompt(600, 80), 4)
    ev.add([step(loop, engine)[1]])                    # the old cache went to the host tier
    assert loop.scheduler.lanes and len(loop.scheduler.kv.host) == 1
    ev.check()
    ev.add(drive(loop, engine, sink.done.is_set))
    ev.check()


def test_a_running_lane_is_reported_as_its_prompt_is_prefilled(stepped):
    loop, engine, _, _ = stepped(max_batch=2, prefill_budget=64)
    ev = Events(loop)
    A = prompt(100, 200)
    _, sink = submit(loop, A, 3)
    held = []
    while not sink.done.is_set():
        ev.add([step(loop, engine)[1]])
        ev.check()
        if loop.scheduler.lanes:
            held.append(len(replay(ev.all).get(("gpu", loop.scheduler.lanes[0].slot), [])))
    assert held[:3] == [64, 128, 192]                    # each prefill chunk, while the lane runs
    assert replay(ev.all) == {("gpu", s): t for (_, s), t in actual(loop).items()}
