"""The prefix cache keyed by LoRA adapter set, with the real scheduler and KV manager on a FAKE
engine (tests/unit/fake_lora.py) whose KV depends on the adapter each token was computed under:
a prefix cached under one set (a free slot's cache, a running lane's KV, the host tier, a park
artifact) is never served under another or under the base model. Each test would fail if a
cross-adapter hit were served: the reply would not be the cold reply of its own set."""

from __future__ import annotations

from superfluid.core.prefix import HostTier, SlotCache

from .fake_lora import FakeLoraEngine, expected_under, load_stepped
from .fakes import drive, submit

A, B = (("a", 1.0),), (("b", 1.0),)
A_HALF = (("a", 0.5),)
PROMPT = [(7 * i) % 1000 for i in range(200)]


def _one(loop, engine, tokens, n, adapters):
    _, sink = submit(loop, tokens, n, adapters=adapters)
    stats = drive(loop, engine, sink.done.is_set)
    assert sink.token_ids == expected_under(tokens, n, adapters), adapters
    return sum(s.cache_hit_tokens for s in stats)


def test_same_prompt_under_each_set_is_never_served_another_sets_prefix(make, tmp_path):
    engine = FakeLoraEngine(max_lanes=2, supports_parking=False)  # no host tier: slot caches only
    loop, engine = make(engine, max_batch=2, start=False)
    load_stepped(loop, engine, tmp_path, "a", "b")
    assert _one(loop, engine, PROMPT, 4, A) == 0
    assert _one(loop, engine, PROMPT + [1, 2], 4, A) >= len(PROMPT)  # a's own prefix is reused
    assert _one(loop, engine, PROMPT, 4, B) == 0        # a's cache is no prefix of b's
    assert _one(loop, engine, PROMPT, 4, ()) == 0       # nor of the base model's
    assert _one(loop, engine, PROMPT, 4, A_HALF) == 0   # nor of a at another scale
    assert engine.errors == []


def test_a_running_lanes_kv_seeds_only_its_own_set(make, tmp_path):
    engine = FakeLoraEngine(max_lanes=3)
    loop, engine = make(engine, max_batch=3, start=False, prefill_budget=64)
    load_stepped(loop, engine, tmp_path, "a", "b")
    long = PROMPT * 3
    sinks = [(submit(loop, long + [i], 3, adapters=s)[1], s, i) for i, s in enumerate([A, B, A])]
    drive(loop, engine, lambda: all(k.done.is_set() for k, *_ in sinks), max_ticks=500)
    for sink, s, i in sinks:
        assert sink.token_ids == expected_under(long + [i], 3, s), s
    assert engine.errors == []


def test_host_tier_prefix_is_restored_only_under_its_set(make, tmp_path):
    engine = FakeLoraEngine(max_lanes=1)  # one slot: every new prompt evicts the cache to the host tier
    loop, engine = make(engine, max_batch=1, start=False, host_cache_bytes=1 << 30)
    load_stepped(loop, engine, tmp_path, "a")
    _one(loop, engine, PROMPT, 2, A)
    _one(loop, engine, [999] * 100, 2, ())  # overwrites the slot: a's prefix goes to host memory
    assert len(loop.scheduler.kv.host) >= 1
    assert _one(loop, engine, PROMPT + [5], 2, ()) == 0  # not from a's host entry
    assert engine.errors == []


def test_slot_cache_and_host_tier_match_only_the_same_set():
    cache = SlotCache()
    cache.store(0, PROMPT, A)
    assert cache.best_slot(PROMPT + [1], [0], adapters=A) == (0, len(PROMPT))
    assert cache.best_slot(PROMPT + [1], [0], adapters=B)[1] == 0
    assert cache.best_slot(PROMPT + [1], [0])[1] == 0
    host = HostTier(1 << 30)
    key = host.add(PROMPT, adapters=A)
    assert host.best(PROMPT + [1], A) == (key, len(PROMPT))
    assert host.best(PROMPT + [1], B) == (None, 0)
    assert host.best(PROMPT + [1]) == (None, 0)


def test_kv_events_name_the_adapter_and_hash_its_blocks_apart():
    """KV events (plugins/kvevents): a prefix held under an adapter is published with its
    lora_name, under other block hashes than the same tokens of the base model."""
    from superfluid.core.cache_events import CacheEvent
    from superfluid.plugins.kvevents.blocks import BlockLedger

    ledger = BlockLedger("m", 16)
    base = ledger.apply([CacheEvent("stored", "gpu", 0, PROMPT, 64)])
    lora = ledger.apply([CacheEvent("stored", "gpu", 1, PROMPT, 64, A)])
    assert base[0].lora_name is None and lora[0].lora_name == "a"
    assert not set(base[0].block_hashes) & set(lora[0].block_hashes)


def test_an_unloaded_adapters_prefixes_go_with_it(make, tmp_path):
    """An adapter loaded again under the same name may be another file: nothing cached under the
    old one may seed it."""
    engine = FakeLoraEngine(max_lanes=1)
    loop, engine = make(engine, max_batch=1, start=False, host_cache_bytes=1 << 30)
    load_stepped(loop, engine, tmp_path, "a")
    _one(loop, engine, PROMPT, 2, A)
    _one(loop, engine, [999] * 100, 2, ())       # a's prefix to the host tier
    _one(loop, engine, PROMPT[:100] + [3] * 80, 2, A)  # and a slot cache under a again
    loop.adapters.remove("a")
    loop.step()                                  # unloaded: its prefixes are dropped
    assert not loop.scheduler.kv.host.keys_under("a")
    assert all("a" not in dict(loop.scheduler.kv.cache.adapters(s)) for s in loop.scheduler.kv.cache.lru_slots())
    load_stepped(loop, engine, tmp_path, "a")   # another "a"
    assert _one(loop, engine, PROMPT + [1], 2, A) == 0
    assert engine.errors == []
