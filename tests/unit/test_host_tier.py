"""The host tier: cached prefixes evicted from their slot are parked in host memory, up to
--host-cache-mb, least recently used first out, and come back to seed a lane. ``HostTier``
(core/prefix.py) called directly, then the loop on the fake engine with a prefix cache and
parking (``fakes.py``), whose sampler hashes the slot's whole KV: every output is compared with
the cold one."""

from __future__ import annotations

from superfluid.core.prefix import MIN_HOST_TOKENS, HostTier

from .fakes import cached_by_slot, drive, expected, prompt, run_stepped, run_threaded, submit


# ---- HostTier ---------------------------------------------------------------------------------------

def test_host_tier_add_thresholds():
    assert HostTier(0).add(prompt(0, 500)) is None                    # no host memory
    host = HostTier(1 << 20)
    assert host.add(prompt(0, MIN_HOST_TOKENS - 1)) is None            # too short to keep
    k1 = host.add(prompt(0, MIN_HOST_TOKENS))
    k2 = host.add(prompt(100, 80))
    assert k1 and k2 and k1 != k2 and len(host) == 2
    assert host.bytes == 0                                             # sizes come from the engine


def test_host_tier_parked_sizes():
    host = HostTier(1 << 20)
    k1, k2 = host.add(prompt(0, 70)), host.add(prompt(100, 70))
    host.parked(k1, 1000)
    host.parked(k2, 500)
    assert host.bytes == 1500
    host.parked("prefix-unknown", 99)                                  # ignored
    assert host.bytes == 1500 and len(host) == 2
    host.parked(k2, 0)                                                 # the engine could not park it
    assert len(host) == 1 and host.bytes == 1000
    assert host.best(prompt(100, 70)) == (None, 0)


def test_host_tier_bytes_follow_every_change():
    host = HostTier(1 << 20)
    k1, k2, k3 = (host.add(prompt(i * 100, 70)) for i in range(3))
    host.parked(k1, 1000)
    host.parked(k2, 500)
    host.parked(k1, 600)                                               # reported again: replaced, not added
    assert host.bytes == 1100
    host.remove(k2)
    host.remove(k2)                                                    # gone already: nothing changes
    assert host.bytes == 600 and len(host) == 2
    host.parked(k3, 50)
    host.remove(k1)
    assert host.bytes == 50


def test_host_tier_best():
    host = HostTier(1 << 20)
    p = prompt(100, 120)
    k_short = host.add(p[:70] + [999] * 10)
    k_long = host.add(p[:100])
    host.add(prompt(500, 90))
    assert host.best(p) == (k_long, 100)
    assert host.best(p[:100]) == (k_long, 99)        # one token is always left to feed
    assert host.best(p[:80] + [5] * 30) == (k_long, 80)
    assert host.best(p[:75] + [5] * 30) == (k_long, 75)
    assert host.best(p[:70] + [999] * 10 + [5]) == (k_short, 80)
    assert host.best(prompt(800, 90)) == (None, 0)
    assert HostTier(1 << 20).best(p) == (None, 0)


def test_host_tier_trim_lru_until_under_limit(prefix_clock):
    host = HostTier(1000)
    keys = []
    for i in range(3):
        keys.append(host.add(prompt(i * 100, 70)))
        host.parked(keys[-1], 400)
        prefix_clock.advance(1)
    assert host.trim() == [keys[0]]                   # 1200 > 1000: the oldest goes
    assert host.bytes == 800 and host.trim() == []    # under the limit: nothing
    k3 = host.add(prompt(500, 70))
    host.parked(k3, 400)
    prefix_clock.advance(1)
    key, _ = host.best(prompt(100, 90))
    assert key == keys[1]
    host.touch(key)                                   # imported: keys[1] becomes recent
    prefix_clock.advance(1)
    assert host.trim() == [keys[2]]
    big = HostTier(1000)
    kb = big.add(prompt(0, 70))
    big.parked(kb, 5000)                              # larger than the whole tier
    assert big.trim() == [kb] and len(big) == 0


def test_host_tier_clear():
    host = HostTier(1 << 20)
    keys = [host.add(prompt(i * 100, 70)) for i in range(3)]
    host.parked(keys[0], 10)
    assert host.clear() == keys
    assert len(host) == 0 and host.bytes == 0 and host.clear() == []


# ---- the loop ---------------------------------------------------------------------------------------

def test_evicted_prefix_comes_back_from_host_memory(make):
    loop, engine = make(max_batch=1, prefix_cache=True, host_cache_bytes=1 << 20)
    p1, p2 = prompt(100, 100), prompt(300, 100)
    run_threaded(loop, engine, p1, 2)
    run_threaded(loop, engine, p2, 2)
    parks = [pk for plan in engine.plans_snapshot() for pk in plan.park]
    assert parks == [(0, "prefix-1")]                   # p1's slot went to host memory for p2
    _, lp = run_threaded(loop, engine, p1, 2)
    assert lp.reset and lp.seed.key == "prefix-1" and lp.seed.shared and lp.pos == 99
    assert "prefix-1" in engine.parked                  # kept parked for other lanes
    assert [pk for plan in engine.plans_snapshot() for pk in plan.park][-1] == (0, "prefix-2")
    assert len(loop.scheduler.kv.host) == 2 and engine.errors == []


def test_host_lru_not_refreshed_by_a_lookup_that_imports_nothing(stepped):
    """One slot, 1 MiB of host memory (two 400 kB prefixes). S is a 20-token system prompt.
    P1 = S+x is evicted to host (h1) by P2, P2 (unrelated) by P3 = S+y (h2; P3 imports h1's S:
    a real use). P3's next turn is seeded from the slot (100 tokens) and imports nothing, yet the
    lookup refreshes h1. P4 evicts P3's turn (h3): over the limit, the least recently used entry
    is h1 (last used when P3 started, before h2 was evicted), so P2 must still come back."""
    loop, engine, _, _ = stepped(max_batch=1, host_cache_bytes=1 << 20)
    S = prompt(900, 20)
    p1, p2, p3 = S + prompt(100, 80), prompt(300, 100), S + prompt(500, 80)
    p3_next = p3 + prompt(600, 20)
    run_stepped(loop, engine, p1, 1)
    run_stepped(loop, engine, p2, 1)                     # p1 -> h1 ("prefix-1")
    _, lp, _ = run_stepped(loop, engine, p3, 1)          # p2 -> h2; p3 imports S from h1
    assert lp.seed.key == "prefix-1" and lp.pos == 20
    _, lp, _ = run_stepped(loop, engine, p3_next, 1)     # seeded from the slot, not from h1
    assert lp.seed.key is None and lp.pos == 100
    run_stepped(loop, engine, prompt(700, 100), 1)       # p3_next -> h3; the tier trims one entry
    assert len(loop.scheduler.kv.host) == 2
    _, lp, _ = run_stepped(loop, engine, p2, 1)
    assert lp.seed.key == "prefix-2" and lp.pos == 99


def test_a_tick_moves_a_bounded_amount_of_evicted_kv_to_host_memory(stepped):
    """Free slots hold 600-token caches; four agents and then a chat arrive at once. Each
    agent's slot goes to host memory first (a copy at the start of the tick, while every stream
    waits), so one tick parks PARK_TOKENS_PER_TICK tokens at most plus the one that crossed it,
    and the other agents wait a tick each; the chat (an urgent class) is admitted in the first
    tick all the same. Everything finishes with its cold output and every cache reaches host
    memory."""
    from superfluid.core.kv_room import PARK_TOKENS_PER_TICK

    loop, engine, _, _ = stepped(max_batch=5, host_cache_bytes=1 << 30)
    first = [submit(loop, prompt(10 * i + 1, 600), 1)[1] for i in range(4)]
    drive(loop, engine, lambda: all(s.done.is_set() for s in first))
    cached = list(cached_by_slot(loop).values()).count(600)
    assert cached >= 3
    agents = [prompt(500 + 7 * i, 50) for i in range(4)]   # no prefix shared with anything
    sinks = [submit(loop, p, 2)[1] for p in agents]
    chat = submit(loop, prompt(900, 30), 2, qos="interactive")[1]
    n0 = len(engine.plans)
    drive(loop, engine, lambda: chat.done.is_set() and all(s.done.is_set() for s in sinks))
    plans = engine.plans[n0:]
    parked = [600 * len(p.park) for p in plans]
    assert all(n < PARK_TOKENS_PER_TICK + 600 for n in parked), parked
    assert sum(parked) == cached * 600 and len([n for n in parked if n]) >= 2   # spread over ticks
    first_slots = {lp.slot for lp in plans[0].lanes}
    chat_slot = next(lp.slot for p in plans for lp in p.lanes if lp.pos == 0 and lp.feed[:1] == [900])
    assert chat_slot in first_slots                                    # the chat did not wait
    for s, p in zip(sinks + [chat], agents + [prompt(900, 30)]):
        assert s.token_ids == expected(p, 2)
