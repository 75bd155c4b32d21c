"""Spare slots (``EngineCapabilities.spare_slots``: llama.cpp's sequences beyond the lanes) and a
shared pool's bounded prefix cache (``EngineCapabilities.shared_pool``).

A free slot keeps its finished lane's KV as a cached prefix. With spare slots the KV manager binds
lanes to any slot while running no more than --max-batch lanes, so the most recently finished
conversations stay in the pool: a returning one is seeded from its slot in place, one pushed out
of the pool comes back from host memory. In a shared pool the cached prefixes keep at most one
lane's context of cells; the rest goes to host memory, oldest first.

The real scheduler and qos policies drive the fake engine (``fakes.py``), whose sampler hashes the
slot's whole KV: a lane seeded with the wrong KV samples other tokens than a cold run, and every
output is compared with ``expected()``."""

from __future__ import annotations

from superfluid.core.prefix import SlotCache

from .fakes import FakeEngine, FakePoolEngine, cached_by_slot, expected, prompt, run_threaded, submit, wait_for

HOST = 1 << 24  # bytes of host memory for evicted prefixes (the fake parks 4000 bytes a token)


def spare_loop(make, *, max_batch=2, spare=2, **kw):
    engine = FakeEngine(max_lanes=max_batch, prefix_cache=True, spare_slots=spare)
    return make(engine, max_batch=max_batch, host_cache_bytes=HOST, **kw)


def parks(engine, since: int) -> list[int]:
    return [slot for plan in engine.plans_snapshot()[since:] for slot, _ in plan.park]


def host_hits(observer, loop) -> int:
    return sum(s.cache_host_hits for s in observer.of(loop.name))


def turn(loop, engine, tokens, n=3):
    """One conversation turn, run alone; (sampled tokens, its first LanePlan)."""
    sink, lp = run_threaded(loop, engine, tokens, n)
    return sink.token_ids, lp


def test_every_slot_is_free_but_only_max_batch_lanes_may_bind(make):
    loop, engine = spare_loop(make, max_batch=2, spare=2, start=False)
    kv = loop.scheduler.kv
    assert kv.n_slots == 4 and sorted(kv.free) == [0, 1, 2, 3]
    assert kv.free_lanes == 2 and kv.slot_state() == "free"
    snap = loop.snapshot()
    assert len(snap["slots"]) == 4 and snap["max_batch"] == 2


def test_returning_conversation_is_seeded_in_place_from_a_spare_buffer(make, observer):
    """--max-batch 2 with two spare slots: three conversations A, B, C each take a turn; A comes
    back and its second turn is seeded from its own slot, whole, with nothing loaded from (or
    sent to) host memory."""
    loop, engine = spare_loop(make)
    convs = [prompt(100, 60), prompt(300, 60), prompt(500, 60)]
    replies, slots = [], []
    for p in convs:
        reply, lp = turn(loop, engine, p)
        replies.append(reply)
        slots.append(lp.slot)
    assert len(set(slots)) == 3                  # each took a slot of its own: all three cached
    assert wait_for(lambda: sum(1 for n in cached_by_slot(loop).values() if n) == 3)
    n0 = len(engine.plans_snapshot())
    a2 = convs[0] + replies[0] + prompt(700, 20)
    _, lp = turn(loop, engine, a2)
    assert lp.slot == slots[0] and lp.seed.own and lp.seed.key is None
    assert lp.pos == 60 + 3 - 1                  # the whole first turn but its last sampled token
    assert parks(engine, n0) == []               # nothing went to host memory ...
    assert host_hits(observer, loop) == 0        # ... and nothing came from it
    assert loop.scheduler.kv.host.bytes == 0
    assert engine.errors == []


def test_conversation_pushed_out_of_the_pool_comes_back_from_host_memory(make, observer):
    """Four slots, five conversations: the fifth takes the least recently finished one's slot
    (A, whose KV goes to host memory whole); A's next turn is seeded from host memory, while the
    most recent ones (B to E) stay in the pool."""
    loop, engine = spare_loop(make)
    convs = [prompt(100 + 150 * i, 70) for i in range(5)]
    replies, slots = [], []
    for i, p in enumerate(convs):
        n0 = len(engine.plans_snapshot())
        reply, lp = turn(loop, engine, p)
        replies.append(reply)
        slots.append(lp.slot)
        if i == 4:
            assert lp.slot == slots[0] and parks(engine, n0) == [slots[0]]  # A, the oldest, went to host
    a2 = convs[0] + replies[0] + prompt(900, 20)
    _, lp = turn(loop, engine, a2)
    assert lp.seed.shared and lp.seed.key is not None and lp.pos == 70 + 3 - 1
    assert wait_for(lambda: host_hits(observer, loop) == 1)
    e2 = convs[4] + replies[4] + prompt(950, 20)  # the newest is still in the pool
    _, lp = turn(loop, engine, e2)
    assert lp.seed.own and lp.pos == 70 + 3 - 1
    assert host_hits(observer, loop) == 1
    assert engine.errors == []


def test_running_lanes_never_exceed_max_batch(make):
    """Six requests at once against --max-batch 2 with two spare slots: no tick runs more than
    two lanes (the fake engine records any more as an error), every request completes, and the
    lanes land in the spare slots too."""
    loop, engine = spare_loop(make, max_batch=2, spare=2)
    prompts = [prompt(100 + 100 * i, 40) for i in range(6)]
    sinks = [submit(loop, p, 5)[1] for p in prompts]
    for p, sink in zip(prompts, sinks):
        assert sink.wait().kind == "finished" and sink.token_ids == expected(p, 5)
    plans = engine.plans_snapshot()
    assert max(len(plan.lanes) for plan in plans) == 2
    assert {lp.slot for plan in plans for lp in plan.lanes} - {0, 1}  # spare slots were used
    assert engine.errors == []


def test_a_shared_system_prompt_copies_into_the_oldest_cache_not_the_newest(make):
    """Every slot holds a conversation that starts with the same system prompt; a new one that
    shares only that prompt takes the least recently finished cache (sent to host memory whole
    before it is cut), so the newest stay whole in the pool."""
    loop, engine = spare_loop(make)
    system = prompt(10, 30)
    convs = [system + prompt(100 + 100 * i, 50) for i in range(4)]
    slots = [turn(loop, engine, p)[1].slot for p in convs]
    assert len(set(slots)) == 4
    n0 = len(engine.plans_snapshot())
    _, lp = turn(loop, engine, system + prompt(800, 50))
    assert lp.slot == slots[0] and lp.pos == 30   # the oldest cache, cut after the system prompt ...
    assert parks(engine, n0) == [slots[0]]        # ... once all of it went to host memory
    cached = cached_by_slot(loop)
    assert all(cached[s] == 80 + 3 - 1 for s in slots[1:])  # the three newer ones are whole
    assert engine.errors == []


def test_shared_pool_keeps_one_lanes_context_of_cached_prefixes(make, observer):
    """A shared pool of 1000 cells, context 200: three finished conversations of 123 tokens would
    hold 369 cells as cached prefixes; the cache keeps at most 200, the oldest go to host memory
    (reason ``cache_bound``), and one of those comes back from there."""
    engine = FakePoolEngine(pool=1000, max_lanes=2, context_length=200, spare_slots=2, shared_pool=True)
    loop, engine = make(engine, max_batch=2, host_cache_bytes=HOST)
    convs = [prompt(100 + 150 * i, 120) for i in range(3)]
    replies = [turn(loop, engine, p, 4)[0] for p in convs]
    kv = loop.scheduler.kv
    assert wait_for(lambda: kv.cache.cached_tokens() <= 200)
    assert kv.cache.cached_tokens() == 123        # the newest alone: two would be 246
    evicted = sum(s.evictions.get("cache_bound", 0) for s in observer.of(loop.name))
    assert evicted == 2 and len(kv.host) == 2
    _, lp = turn(loop, engine, convs[0] + replies[0] + prompt(900, 20))
    assert lp.seed.shared and lp.pos == 123
    assert engine.errors == []


def test_separate_buffers_keep_every_cached_prefix(make, observer):
    """Without a shared pool a cached prefix costs the lanes nothing: none is bounded away."""
    engine = FakeEngine(max_lanes=2, context_length=200, prefix_cache=True, spare_slots=2)
    loop, engine = make(engine, max_batch=2, host_cache_bytes=HOST)
    for i in range(3):
        turn(loop, engine, prompt(100 + 150 * i, 120), 4)
    assert loop.scheduler.kv.cache.cached_tokens() == 3 * 123
    assert not any(s.evictions for s in observer.of(loop.name))


# ---- the cache's own choices ------------------------------------------------------------------------

def test_least_valuable_slot_is_empty_then_least_recently_used(prefix_clock):
    cache = SlotCache()
    cache.store(0, prompt(100, 20))
    prefix_clock.advance(1)
    cache.store(1, prompt(200, 20))
    assert cache.least_valuable([0, 1, 2]) == 2            # empty first
    assert cache.least_valuable([0, 1]) == 0               # then the oldest
    assert cache.least_valuable([]) is None
    assert cache.worth_less(0, 1) and not cache.worth_less(1, 0) and cache.worth_less(2, 0)
    cache.pin(prompt(100, 10))                             # slot 0's cache is now pinned
    assert cache.least_valuable([0, 1]) == 1 and not cache.worth_less(0, 1) and cache.worth_less(1, 0)


def test_equal_matches_pick_the_least_recently_used_cache(prefix_clock):
    cache = SlotCache()
    system = prompt(10, 30)
    for slot in (2, 0, 1):                                 # 2 oldest, 1 newest
        cache.store(slot, system + prompt(100 * (slot + 1), 40))
        prefix_clock.advance(1)
    assert cache.best_slot(system + prompt(900, 40), [0, 1, 2]) == (2, 30)
    assert cache.best_slot(system + prompt(900, 40), [0, 1]) == (0, 30)


# ---- what the llama.cpp engine declares -------------------------------------------------------------

def test_llamacpp_declares_its_spare_sequences_and_pool_kind():
    from superfluid.core.engine import EngineCapabilities
    from superfluid.plugins.llamacpp.engine import LlamaCppEngine

    engine = object.__new__(LlamaCppEngine)  # no model: only the declaration from the worker's report
    engine.max_lanes = 2
    engine.capabilities = EngineCapabilities(max_lanes=2, context_length=2048, prefix_cache=True)
    info = {"n_ctx": 4 * 2048, "n_seq_max": 4, "kv_unified": False, "bytes_per_cell": 1000}
    engine._declare_layout(info)
    assert engine.capabilities.spare_slots == 2 and not engine.capabilities.shared_pool
    assert info["kv_bytes"] == 4 * 2048 * 1000
    engine._declare_layout({"n_ctx": 4096, "n_seq_max": 4, "kv_unified": True, "bytes_per_cell": 10})
    assert engine.capabilities.spare_slots == 2 and engine.capabilities.shared_pool
