"""The prefix machinery of core/prefix.py: ``common_prefix`` and ``SlotCache`` (cached prefixes
in free slots: LRU order, pinned prefixes, which slot a prompt gets), called directly with the
module's clock moved by the test (``prefix_clock``)."""

from __future__ import annotations

import pytest

from superfluid.core.prefix import MIN_REUSE, SlotCache, common_prefix

from .fakes import prompt


# ---- common_prefix ----------------------------------------------------------------------------------

@pytest.mark.parametrize("a,b,n", [
    ([], [], 0),
    ([], [1, 2], 0),
    ([1, 2], [], 0),
    ([1], [1], 1),
    ([1], [2], 0),
    ([1, 2, 3], [1, 2, 3], 3),
    ([1, 2, 3], [1, 2, 3, 4, 5], 3),          # a prefix of the other
    ([1, 2, 3, 4, 5], [1, 2, 3], 3),
    ([1, 2, 3], [9, 2, 3], 0),                # differ at the first
    ([1, 2, 3], [1, 2, 9], 2),                # differ at the last
    ([1, 2, 3, 4], [1, 2, 3, 5, 6, 7], 3),
])
def test_common_prefix_edges(a, b, n):
    assert common_prefix(a, b) == n
    assert common_prefix(b, a) == n


def test_common_prefix_matches_brute_force():
    import random
    rng = random.Random(1234)
    for _ in range(400):
        n = rng.randrange(0, 120)
        a = [rng.randrange(3) for _ in range(n)]
        cut = rng.randrange(0, n + 1)
        b = a[:cut] + [rng.randrange(3) for _ in range(rng.randrange(0, 40))]
        brute = 0
        while brute < min(len(a), len(b)) and a[brute] == b[brute]:
            brute += 1
        assert common_prefix(a, b) == brute, (a, b)


# ---- SlotCache --------------------------------------------------------------------------------------

def test_slot_cache_store_forget_tokens():
    cache = SlotCache()
    cache.store(1, [1, 2, 3])
    cache.store(2, [4, 5])
    assert cache.tokens(1) == [1, 2, 3] and cache.tokens(3) == []
    assert cache.cached_tokens() == 5
    cache.store(1, [])                 # storing nothing forgets
    assert cache.tokens(1) == [] and cache.cached_tokens() == 2
    cache.forget(2)
    cache.forget(7)                    # unknown: no error
    assert cache.cached_tokens() == 0 and cache.lru_slots() == []


def test_slot_cache_lru_order(prefix_clock):
    cache = SlotCache()
    for slot in (2, 0, 3):
        cache.store(slot, prompt(slot * 100, 20))
        prefix_clock.advance(1)
    assert cache.lru_slots() == [2, 0, 3]
    cache.store(2, prompt(200, 30))    # used again: most recent
    prefix_clock.advance(1)
    assert cache.lru_slots() == [0, 3, 2]
    cache.forget(3)
    assert cache.lru_slots() == [0, 2]


def test_slot_cache_pinned_prefixes_are_evicted_last(prefix_clock):
    system = prompt(1000, 30)
    cache = SlotCache(pinned=[system])
    cache.store(0, system + prompt(100, 20))      # pinned, oldest
    prefix_clock.advance(1)
    cache.store(1, prompt(200, 40))               # unpinned
    prefix_clock.advance(1)
    cache.store(2, system + prompt(300, 20))      # pinned
    prefix_clock.advance(1)
    cache.store(3, prompt(400, 40))               # unpinned, newest
    assert [cache.pinned(s) for s in range(4)] == [True, False, True, False]
    assert cache.lru_slots() == [1, 3, 0, 2]      # unpinned LRU first, then pinned oldest first
    # an unrelated prompt overwrites an unpinned cache, not the older pinned one
    assert cache.best_slot(prompt(900, 40), [0, 1, 2, 3]) == (1, 0)
    assert cache.best_slot(prompt(900, 40), [0, 2]) == (0, 0)   # only pinned left: oldest yields


# ---- best_slot --------------------------------------------------------------------------------------

def test_best_slot_longest_prefix_wins(prefix_clock):
    cache = SlotCache()
    p = prompt(100, 60)
    cache.store(0, p[:20] + [999] * 10)    # shares 20
    cache.store(1, p[:40] + [998])         # shares 40
    cache.store(2, p[:30])                 # shares 30
    assert cache.best_slot(p, [0, 1, 2, 3]) == (1, 40)
    assert cache.best_slot(p, [0, 2, 3]) == (2, 30)     # only free slots count
    assert cache.best_slot(p, [0, 3]) == (0, 20)


def test_best_slot_minimum_reuse(prefix_clock):
    cache = SlotCache()
    p = prompt(100, 200)
    cache.store(0, p[:MIN_REUSE - 1] + [999])
    slot, reuse = cache.best_slot(p, [0, 1, 2])
    assert reuse == 0 and slot in (1, 2)                 # 15 of 200: an empty slot instead
    cache.store(1, p[:MIN_REUSE])
    assert cache.best_slot(p, [0, 1, 2]) == (1, MIN_REUSE)


def test_best_slot_keeps_a_similar_head_in_place(prefix_clock):
    """Below MIN_REUSE nothing is copied, but a cache whose head is a tenth of the prompt or more
    (llama-server's slot similarity) is taken over an empty slot: the scheduler cuts it after
    the head, for free. A pinned cache is never taken for its head."""
    cache = SlotCache()
    p = prompt(100, 40)
    cache.store(0, p[:3] + [999] * 20)                   # 3 of 40: under a tenth
    cache.store(1, p[:7] + [999] * 20)                   # 7 of 40
    cache.store(2, p[:5] + [999] * 20)
    assert cache.best_slot(p, [0, 1, 2, 3]) == (1, 0)
    assert cache.best_slot(p, [0, 3]) == (3, 0)           # a head too short: the empty slot
    cache.pin(p[:7] + [999] * 20)
    assert cache.best_slot(p, [1, 2, 3])[0] == 2
    assert cache.best_slot(p, [1, 2, 3], busy=[6])[0] == 3  # the narrowest span still comes first


def test_best_slot_leaves_a_token_to_feed(prefix_clock):
    cache = SlotCache()
    p = prompt(100, 40)
    cache.store(0, list(p))                              # the whole prompt cached
    assert cache.best_slot(p, [0, 1]) == (0, 39)
    assert cache.best_slot(p[:25], [0, 1]) == (0, 24)   # a prompt shorter than the cache
    short = p[:MIN_REUSE]                                # all MIN_REUSE tokens cached, one must be fed
    assert cache.best_slot(short, [0, 1]) == (0, 0)     # 15 reusable: no copy, the head kept in place
    assert cache.best_slot(p[:MIN_REUSE + 1], [0, 1]) == (0, MIN_REUSE)
    assert cache.best_slot(p[:1], [0]) == (0, 0)


def test_best_slot_fallback_empty_then_lru(prefix_clock):
    cache = SlotCache()
    for slot in (0, 1, 2):
        cache.store(slot, prompt(slot * 100, 30))
        prefix_clock.advance(1)
    other = prompt(700, 30)
    assert cache.best_slot(other, [0, 1, 2, 3]) == (3, 0)  # an empty slot first
    assert cache.best_slot(other, [2, 0, 1]) == (0, 0)     # else the least recently used
    cache.store(0, prompt(0, 30))
    prefix_clock.advance(1)
    assert cache.best_slot(other, [2, 0, 1]) == (1, 0)
    assert cache.best_slot([], [2, 0, 1]) == (1, 0)        # a parked lane: no reuse at all


def test_best_slot_keeps_busy_slots_together(prefix_clock):
    """With ``busy`` given (an engine with compact_slots: llama.cpp attends over every KV buffer
    between the lowest and highest slot in a step) the slot next to the busy ones wins over an
    older cache or an empty slot further away; a reusable prefix still wins over both."""
    cache = SlotCache()
    for slot in (6, 7, 2):
        cache.store(slot, prompt(slot * 100, 20))
        prefix_clock.advance(1)
    free = [1, 2, 5, 6, 7]                                   # 0, 3, 4 are busy
    assert cache.best_slot(prompt(900, 30), free) == (5, 0)          # no busy info: an empty slot
    assert cache.best_slot(prompt(900, 30), free, [0, 3, 4]) == (1, 0)  # inside 0..4, empty first
    assert cache.best_slot(prompt(900, 30), [5, 6, 7], [3, 4]) == (5, 0)
    assert cache.best_slot(prompt(900, 30), [6, 7], [0]) == (6, 0)   # the nearer cache, though newer
    assert cache.best_slot(prompt(700, 30), [6, 7], [0]) == (7, 20)  # reuse beats span
