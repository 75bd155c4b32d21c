"""Replan: a plan the engine's shared KV pool cannot hold is refused (TickResult.rejected_tokens)
and the KV manager frees room (cached prefixes, unpinned first, pinned last; then the newest
lanes, requeued) and the scheduler plans again. Requests beyond what the pool holds queue; none
fails.

The real scheduler and qos policies, stepped through ``ModelLoop.step()``, drive
``FakePoolEngine`` (``fakes.py``): the fake engine with a prefix cache and a pool of ``pool``
cells that refuses a whole tick whose tokens do not fit (it applies the plan's parks, releases
and seeds, as the llama.cpp runner does before its first step, and feeds nothing)."""

from __future__ import annotations

from superfluid.core.lane import LaneState

from .fakes import FakePoolEngine, drive, expected, prompt, step, submit

NO_WATERMARKS = dict(pressure_high=1.0, pressure_low=0.9)


def test_refused_plan_evicts_unpinned_prefixes_first_then_pinned(make, observer):
    system = prompt(1000, 40)
    engine = FakePoolEngine(pool=300, max_lanes=4)
    loop, engine = make(engine, start=False, pinned_tokens=[system], **NO_WATERMARKS)
    _, a = submit(loop, system + prompt(100, 60), 1)      # pinned cache, 100 tokens
    drive(loop, engine, a.done.is_set)
    _, b = submit(loop, prompt(300, 90), 1)               # unpinned cache, 90 tokens
    drive(loop, engine, b.done.is_set)
    assert loop.scheduler.kv.cache.cached_tokens() == 190
    tokens = prompt(500, 150)
    _, c = submit(loop, tokens, 4)                        # 154 more: 344 > 300
    stats = drive(loop, engine, c.done.is_set)
    assert c.events[-1].kind == "finished" and c.token_ids == expected(tokens, 4)
    refusals = [s for s in stats if s.pool_rejections]
    assert refusals and refusals[0].evictions == {"pool_full": 1}
    # the unpinned cache went first and that was enough: the pinned one stays
    cache = loop.scheduler.kv.cache
    assert [len(cache.tokens(s)) for s in range(4) if cache.tokens(s)].count(100) == 1
    assert "paused" not in c.kinds()
    assert engine.errors == []


def test_refused_plan_releases_pinned_prefix_when_unpinned_is_not_enough(make):
    system = prompt(1000, 40)
    engine = FakePoolEngine(pool=260, max_lanes=4)
    loop, engine = make(engine, start=False, pinned_tokens=[system], **NO_WATERMARKS)
    _, a = submit(loop, system + prompt(100, 60), 1)      # pinned, 100
    drive(loop, engine, a.done.is_set)
    _, b = submit(loop, prompt(300, 30), 1)               # unpinned, 30
    drive(loop, engine, b.done.is_set)
    tokens = prompt(500, 200)
    _, c = submit(loop, tokens, 3)                        # needs 202: only with both caches gone
    stats = drive(loop, engine, c.done.is_set)
    assert c.events[-1].kind == "finished" and c.token_ids == expected(tokens, 3)
    evicted = [s.evictions.get("pool_full", 0) for s in stats if s.pool_rejections]
    assert sum(evicted) == 2 and loop.scheduler.kv.cache.cached_tokens() <= 202
    assert engine.errors == []


def test_requests_beyond_the_pool_queue_and_all_complete(make, observer):
    """Eight requests of 150 + 30 tokens against a pool of 600 cells (about three at once): the
    newest lanes are requeued (paused, then resumed), admission holds at what the pool holds,
    and every request completes with the tokens it gets alone."""
    engine = FakePoolEngine(pool=600, max_lanes=8)
    loop, engine = make(engine, start=False, max_batch=8, **NO_WATERMARKS)
    prompts = [prompt(100 * i + 7, 150) for i in range(8)]
    sinks = [submit(loop, p, 30)[1] for p in prompts]
    stats = drive(loop, engine, lambda: all(s.done.is_set() for s in sinks), max_ticks=2000)
    for p, s in zip(prompts, sinks):
        assert s.events[-1].kind == "finished", s.kinds()
        assert s.token_ids == expected(p, 30)
        assert "error" not in s.kinds()
    assert engine.refused >= 1 and sum(s.pool_rejections for s in stats) == engine.refused
    assert any("paused" in s.kinds() for s in sinks)  # the newest were requeued, not failed
    assert engine.errors == []
    # after the first refusal, no more lanes run at once than the pool held
    first = next(i for i, s in enumerate(stats) if s.pool_rejections)
    assert max(s.lanes_busy for s in stats[first + 1:]) <= 4
    # refusals are rare once admission holds: not one per tick
    assert engine.refused <= len(stats) // 3


def test_refused_plan_with_one_lane_left_never_preempts_it(make):
    """A lane alone in the pool is never requeued by a refusal (the pool holds one lane)."""
    engine = FakePoolEngine(pool=5000, max_lanes=2)
    loop, engine = make(engine, start=False, max_batch=2, **NO_WATERMARKS)
    tokens = prompt(3, 100)
    _, s = submit(loop, tokens, 5)
    plan, _ = step(loop, engine)
    lane = loop.lanes[0]
    # a refusal reported for the only lane: nothing cached to evict, nobody else to requeue
    kv = loop.scheduler.kv
    kv.used, kv.capacity = 4990, 5000
    verdict = kv.pool_refused(50, loop.lanes, progressed=False)
    assert verdict.requeue == [] and verdict.fail is None
    assert loop.lanes == [lane] and lane.state != LaneState.PREEMPTED
    drive(loop, engine, s.done.is_set)
    assert s.events[-1].kind == "finished" and s.token_ids == expected(tokens, 5)


# ---- the pool's layout and options ------------------------------------------------------------------

def test_llamacpp_layout_with_a_forced_and_capped_pool():
    from superfluid.plugins.kvpool.layout import FreeMemory, decide

    def layout(lanes, ctx, shared, per_cell, free, fraction, pool_cells=0):
        d = decide(lanes, ctx, shared, per_cell, FreeMemory(free), fraction, pool_cells)
        return d.n_seq, d.n_ctx, d.unified

    gib = 1 << 30
    assert layout(4, 2048, False, 1000, gib, 0.6) == (6, 6 * 2048, False)            # a buffer per lane
    assert layout(4, 2048, True, 1000, 64 * gib, 0.6) == (6, 4 * 2048, True)         # one pool, lanes × ctx
    assert layout(4, 2048, True, 1000, 1_000_000, 0.6) == (6, 2048, True)           # capped, but one lane fits
    assert layout(16, 2048, True, 1000, 64 * gib, 0.6, pool_cells=3000) == (18, 3000, True)  # --kv-pool-cells
    assert layout(16, 2048, True, 1000, 64 * gib, 0.6, pool_cells=100) == (18, 2048, True)


def test_kv_options_are_model_scoped_flags(tmp_path):
    from superfluid.core.cli import load
    config, _ = load(["serve", "--kv-unified", "--kv-pool-cells", "4096"])
    assert config.models[0]["kv-unified"] is True and config.models[0]["kv-pool-cells"] == 4096
    toml = tmp_path / "c.toml"
    toml.write_text('[[models]]\nname = "a"\npath = "/x.gguf"\nkv-unified = true\nkv-pool-cells = 8192\n')
    config, _ = load(["serve", "--config", str(toml)])
    assert config.models[0]["kv-unified"] is True and config.models[0]["kv-pool-cells"] == 8192
