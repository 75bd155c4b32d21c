"""Replan: a plan the engine's shared KV pool cannot hold is refused (TickResult.rejected_tokens)
and the scheduler frees room (cached prefixes, unpinned first, pinned last; then the newest
lanes, requeued) and plans again. Requests beyond what the pool holds queue; none fails.

The real Scheduler and qos policies drive FakePoolEngine: the prefix-cache fake of
test_pressure_cache with a pool of ``pool`` cells that refuses a whole tick whose tokens do not
fit (it applies the plan's parks, releases and seeds, as the llama.cpp runner does before its
first step, and feeds nothing)."""

from __future__ import annotations

import copy

from superfluid.core.lane import LaneState
from superfluid.core.tick import LaneResult

from .test_pressure_cache import (FakePrefixEngine, drive, expected, make, observer,  # noqa: F401
                                  plugin_manager, prompt, step, submit)

NO_WATERMARKS = {"pressure-high": 1.0, "pressure-low": 0.9}


class FakePoolEngine(FakePrefixEngine):
    def __init__(self, *, pool: int, **kw):
        super().__init__(kv_capacity=pool, **kw)
        self.pool = pool
        self.refused = 0
        self.live_peak = 0

    def run_tick(self, plan):
        held = {s: len(v) for s, v in self.kv.items() if s not in plan.release}
        for lp in plan.lanes:
            held[lp.slot] = lp.pos
        need = sum(len(lp.feed) + (lp.max_new - 1 if lp.sample else 0) for lp in plan.lanes)
        self.live_peak = max(self.live_peak, len(plan.lanes))
        if not plan.lanes or sum(held.values()) + need <= self.pool:
            return super().run_tick(plan)
        self.refused += 1
        bare = copy.deepcopy(plan)
        for lp in bare.lanes:
            lp.feed, lp.sample, lp.max_new = [], False, 0
        n_errors = len(self.errors)
        result = super().run_tick(bare)
        del self.errors[n_errors:]  # "empty feed": the bare plan feeds nothing on purpose
        with self._lock:
            self.plans[-1] = copy.deepcopy(plan)
        result.lanes = {lp.slot: LaneResult(slot=lp.slot) for lp in plan.lanes}
        result.rejected_tokens = need
        result.stopped_early = True
        result.steps = []
        return result


def test_refused_plan_evicts_unpinned_prefixes_first_then_pinned(make, observer):
    system = prompt(1000, 40)
    engine = FakePoolEngine(pool=300, max_lanes=4)
    sched, engine = make(engine, start=False, extra={**NO_WATERMARKS, "pinned-tokens": [system]})
    _, a = submit(sched, system + prompt(100, 60), 1)      # pinned cache, 100 tokens
    drive(sched, engine, a.done.is_set)
    _, b = submit(sched, prompt(300, 90), 1)               # unpinned cache, 90 tokens
    drive(sched, engine, b.done.is_set)
    assert sched.scheduler.kv.cache.cached_tokens() == 190
    tokens = prompt(500, 150)
    _, c = submit(sched, tokens, 4)                        # 154 more: 344 > 300
    stats = drive(sched, engine, c.done.is_set)
    assert c.events[-1].kind == "finished" and c.token_ids == expected(tokens, 4)
    refusals = [s for s in stats if s.pool_rejections]
    assert refusals and refusals[0].evictions == {"pool_full": 1}
    # the unpinned cache went first and that was enough: the pinned one stays
    assert [len(sched.scheduler.kv.cache.tokens(s)) for s in range(4) if sched.scheduler.kv.cache.tokens(s)].count(100) == 1
    assert "paused" not in c.kinds()
    assert engine.errors == []


def test_refused_plan_releases_pinned_prefix_when_unpinned_is_not_enough(make):
    system = prompt(1000, 40)
    engine = FakePoolEngine(pool=260, max_lanes=4)
    sched, engine = make(engine, start=False, extra={**NO_WATERMARKS, "pinned-tokens": [system]})
    _, a = submit(sched, system + prompt(100, 60), 1)      # pinned, 100
    drive(sched, engine, a.done.is_set)
    _, b = submit(sched, prompt(300, 30), 1)               # unpinned, 30
    drive(sched, engine, b.done.is_set)
    tokens = prompt(500, 200)
    _, c = submit(sched, tokens, 3)                        # needs 202: only with both caches gone
    stats = drive(sched, engine, c.done.is_set)
    assert c.events[-1].kind == "finished" and c.token_ids == expected(tokens, 3)
    evicted = [s.evictions.get("pool_full", 0) for s in stats if s.pool_rejections]
    assert sum(evicted) == 2 and sched.scheduler.kv.cache.cached_tokens() <= 202
    assert engine.errors == []


def test_requests_beyond_the_pool_queue_and_all_complete(make, observer):
    """Eight requests of 150 + 30 tokens against a pool of 600 cells (about three at once): the
    newest lanes are requeued (paused, then resumed), admission holds at what the pool holds,
    and every request completes with the tokens it gets alone."""
    engine = FakePoolEngine(pool=600, max_lanes=8)
    sched, engine = make(engine, start=False, max_batch=8, extra=dict(NO_WATERMARKS))
    prompts = [prompt(100 * i + 7, 150) for i in range(8)]
    sinks = [submit(sched, p, 30)[1] for p in prompts]
    stats = drive(sched, engine, lambda: all(s.done.is_set() for s in sinks), max_ticks=2000)
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
    sched, engine = make(engine, start=False, max_batch=2, extra=dict(NO_WATERMARKS))
    tokens = prompt(3, 100)
    _, s = submit(sched, tokens, 5)
    plan, _ = step(sched, engine)
    lane = sched.lanes[0]
    # a refusal reported for the only lane: nothing cached to evict, nobody else to requeue
    kv = sched.scheduler.kv
    kv.used, kv.capacity = 4990, 5000
    verdict = kv.pool_refused(50, sched.lanes, progressed=False)
    assert verdict.requeue == [] and verdict.fail is None
    assert sched.lanes == [lane] and lane.state != LaneState.PREEMPTED
    drive(sched, engine, s.done.is_set)
    assert s.events[-1].kind == "finished" and s.token_ids == expected(tokens, 5)


def test_llamacpp_layout_with_a_forced_and_capped_pool():
    from superfluid.plugins.llamacpp.worker import layout
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
