"""Prefix seeding: a lane's KV seeded from a cached prefix (its slot's own, cut to the shared
head), a copy of another free slot's cache or a running lane's KV, instead of prefilling it
again. The real scheduler and the default policies drive the fake engine with a prefix cache
(``fakes.py``), whose sampler hashes the slot's whole KV, so a lane seeded with the wrong KV
samples other tokens than a cold run: every output is compared with ``expected()``."""

from __future__ import annotations

from superfluid.core.prefix import MIN_REUSE

from .fakes import (cached_by_slot, drive, expected, prompt, run_stepped, run_threaded, step, submit,
                    wait_for)


# ---- the slot's own cache ---------------------------------------------------------------------------

def test_finished_lane_leaves_its_slot_cached_and_a_repeat_is_seeded(make, observer):
    loop, engine = make(max_batch=2, prefix_cache=True)
    p = prompt(100, 40)
    _, lp1 = run_threaded(loop, engine, p, 3)
    assert lp1.reset and lp1.pos == 0 and lp1.feed == p
    cached = cached_by_slot(loop)
    assert cached == {lp1.slot: 40 + 3 - 1, 1 - lp1.slot: 0}  # prompt + all but the last sampled token
    assert wait_for(lambda: any(s.cached_tokens == 42 for s in observer.of(loop.name)))

    _, lp2 = run_threaded(loop, engine, p, 3)
    assert lp2.reset and lp2.slot == lp1.slot
    assert lp2.pos == len(p) - 1 and lp2.feed == p[-1:]
    assert lp2.seed.own
    assert wait_for(lambda: sum(s.cache_hits for s in observer.of(loop.name)) == 1)
    assert sum(s.cache_hit_tokens for s in observer.of(loop.name)) == len(p) - 1
    assert engine.errors == []


def test_next_turn_is_seeded_with_the_whole_cached_conversation(make):
    loop, engine = make(max_batch=2, prefix_cache=True)
    p = prompt(100, 50)
    s1, _ = run_threaded(loop, engine, p, 4)
    turn2 = p + s1.token_ids + prompt(400, 20)
    _, lp = run_threaded(loop, engine, turn2, 3)
    assert lp.reset and lp.pos == 50 + 4 - 1
    assert lp.feed == turn2[lp.pos:]
    assert engine.errors == []


def test_a_short_prompt_sent_again_keeps_its_head_in_place(make, observer):
    """Too short to be worth a copy (MIN_REUSE), but most of the prompt: the lane takes that
    slot over the empty one and keeps the cached tokens in place; no copy, no restore."""
    loop, engine = make(max_batch=2, prefix_cache=True)
    p = prompt(100, MIN_REUSE)          # every reusable token count is below MIN_REUSE
    _, first = run_threaded(loop, engine, p, 2)
    _, lp = run_threaded(loop, engine, p, 2)
    assert lp.slot == first.slot and lp.reset
    assert lp.pos == MIN_REUSE - 1 and lp.feed == p[-1:]
    assert lp.seed.slot is None and lp.seed.key is None
    assert sum(s.cache_hits for s in observer.of(loop.name)) == 1


def test_a_short_head_is_kept_in_place_when_the_slot_cache_is_overwritten(make, observer):
    """No empty slot left and nothing worth a copy: the lane takes the least recently used cache,
    which first goes to host memory whole, and keeps the few tokens it shares with the prompt
    (llama-server does the same); no copy, no restore."""
    loop, engine = make(max_batch=2, prefix_cache=True, host_cache_bytes=1 << 20)
    a, b = prompt(100, 80), prompt(300, 80)
    _, lp_a = run_threaded(loop, engine, a, 3)
    run_threaded(loop, engine, b, 3)                   # the other slot: both now hold a cache
    c = a[:5] + prompt(600, 70)                         # shares 5 tokens with a: below MIN_REUSE
    n0 = len(engine.plans_snapshot())
    _, lp = run_threaded(loop, engine, c, 3)
    assert lp.slot == lp_a.slot and lp.reset
    assert lp.pos == 5 and lp.feed == c[5:]
    assert lp.seed.slot is None and lp.seed.key is None
    parked = [slot for plan in engine.plans_snapshot()[n0:] for slot, _ in plan.park]
    assert parked == [lp_a.slot]                        # a's whole cache went to host memory first
    assert engine.errors == []

    d = prompt(900, 40)                                 # shares nothing with the LRU cache (b)
    _, lp = run_threaded(loop, engine, d, 3)
    assert lp.pos == 0 and lp.feed == d


# ---- copies -----------------------------------------------------------------------------------------

def test_burst_sharing_a_prefix_copies_it_from_the_running_lane(make):
    loop, engine = make(max_batch=4, prefix_cache=True)
    shared = prompt(100, 64)
    a, b = shared + prompt(600, 10), shared + prompt(700, 12)
    _, sa = submit(loop, a, 5)
    _, sb = submit(loop, b, 5)
    sa.wait(), sb.wait()
    assert sa.token_ids == expected(a, 5) and sb.token_ids == expected(b, 5)
    plans = engine.plans_snapshot()
    fed = sum(len(lp.feed) for plan in plans for lp in plan.lanes if not lp.decode)
    assert fed == len(a) + len(b) - 64           # the shared 64 tokens were prefilled once
    first_b = [lp for plan in plans for lp in plan.lanes if lp.reset and lp.feed[-1] == b[-1]][0]
    assert first_b.pos == 64
    first_a = [lp for plan in plans for lp in plan.lanes if lp.reset and lp.feed[-1] == a[-1]][0]
    assert first_b.seed.slot == first_a.slot or first_b.slot == first_a.slot
    assert engine.errors == []


def test_a_branching_lane_copies_the_cache_and_keeps_it_whole(stepped):
    """A lane that shares only part of a free slot's cache copies that part into an empty slot,
    so the cache (another conversation) stays whole; a lane that would need the slot being
    copied from waits one tick instead of overwriting it (or failing)."""
    loop, engine, _, _ = stepped(max_batch=2)
    conversation = prompt(100, 60)
    run_stepped(loop, engine, conversation, 3)             # cached in one slot: 62 tokens
    (cached_slot,) = [s for s, n in cached_by_slot(loop).items() if n]
    branch = conversation[:30] + prompt(500, 20)
    n0 = len(engine.plans)
    _, a = submit(loop, branch, 2)
    _, b = submit(loop, prompt(700, 40), 2)
    step(loop, engine)
    first = engine.plans[n0]
    (lp,) = first.lanes                                      # b waits: its only slot is a copy source
    assert lp.seed.slot == cached_slot and lp.slot != cached_slot and lp.pos == 30
    drive(loop, engine, lambda: a.done.is_set() and b.done.is_set())
    assert a.token_ids == expected(branch, 2) and b.token_ids == expected(prompt(700, 40), 2)
    assert engine.errors == []
