"""The scheduler stepped through ``ModelLoop.step()`` (no thread): which lanes are admitted and in
what order, how a tick's prefill is cut and ordered, class caps, starvation bounds, and what a
tick's tokens stream. The real scheduler and the default policies (plugins/qos) drive the fake
engine of ``fakes.py``; every request is queued before the first step, as a burst would be."""

from __future__ import annotations

import pytest

from superfluid.core.tick import StepTiming

from .fakes import FakeEngine, drive, expected_tokens, lane_plans, seed_prefill_rate, step, submit


def finish(loop, engine, *sinks) -> list:
    """Step the loop until every sink is done; the TickStats of every tick run."""
    return drive(loop, engine, lambda: all(s.done.is_set() for s in sinks))


# ---- lanes ------------------------------------------------------------------------------------------

def test_never_more_than_max_batch_lanes(make):
    loop, engine = make(max_batch=3, start=False)
    jobs = [([i + 1] * (5 + 7 * i), 1 + i % 5) for i in range(10)]
    sinks = [submit(loop, prompt, n)[1] for prompt, n in jobs]
    finish(loop, engine, *sinks)
    for (prompt, n), sink in zip(jobs, sinks):
        fin = sink.wait()
        assert fin.finish_reason == "length"
        assert fin.completion_tokens == n
        assert sink.token_ids == expected_tokens(prompt[-1], n)
    plans = engine.plans_snapshot()
    assert plans
    assert max(len(p.lanes) for p in plans) <= 3
    assert max(len(p.lanes) for p in plans) == 3   # the batch was actually full at some point
    for p in plans:
        assert {lp.slot for lp in p.lanes} <= {0, 1, 2}
    assert engine.errors == []


# ---- prefill budget and ordering --------------------------------------------------------------------

@pytest.mark.parametrize("rate, chunk", [
    (0.0008, 512),   # 0.5 s holds 625 tokens: whole 512-token chunks
    (0.001, 384),    # 0.5 s holds 500 tokens: too slow for one chunk, so 128-token steps
])
def test_long_prompt_split_while_a_lane_is_free(make, rate, chunk):
    engine = FakeEngine(max_lanes=8, prefill_s_per_token=rate)
    loop, engine = make(engine, max_batch=8, prefill_budget=4096, start=False)
    seed_prefill_rate(loop, rate)
    _, sink = submit(loop, [3] * 3000, 2)
    finish(loop, engine, sink)
    fin = sink.wait()
    assert fin.finish_reason == "length" and fin.completion_tokens == 2
    chunks = lane_plans(engine, 3)
    sizes = [len(lp.feed) for _, lp in chunks]
    assert sum(sizes) == 3000
    assert len(sizes) == -(-3000 // chunk)
    assert all(n == chunk for n in sizes[:-1]), sizes
    assert 0 < sizes[-1] <= chunk
    assert [lp.sample for _, lp in chunks] == [False] * (len(sizes) - 1) + [True]
    ticks = [i for i, _ in chunks]
    assert len(set(ticks)) == len(ticks)            # one chunk per tick
    first_plan = engine.plans_snapshot()[ticks[0]]
    assert first_plan.prefill_budget == chunk
    assert loop.scheduler.costs.prefill_per_token() == pytest.approx(rate, rel=1e-3)
    assert engine.errors == []


def test_long_prompt_in_one_tick_when_every_lane_is_busy(make):
    rate = 0.0008
    loop, engine = make(FakeEngine(max_lanes=1, prefill_s_per_token=rate), max_batch=1,
                        prefill_budget=4096, start=False)
    seed_prefill_rate(loop, rate)
    _, sink = submit(loop, [3] * 3000, 2)
    finish(loop, engine, sink)
    sink.wait()
    sizes = [len(lp.feed) for _, lp in lane_plans(engine, 3)]
    assert sizes == [3000]


def test_prefill_budget_caps_a_tick(make):
    loop, engine = make(max_batch=4, prefill_budget=256, start=False)
    seed_prefill_rate(loop, 1e-5)
    _, sink = submit(loop, [4] * 1000, 1)
    finish(loop, engine, sink)
    sink.wait()
    sizes = [len(lp.feed) for _, lp in lane_plans(engine, 4)]
    assert sizes == [256, 256, 256, 232]


def test_shorter_remaining_prompt_prefilled_first(make):
    loop, engine = make(max_batch=4, prefill_budget=256, start=False)
    seed_prefill_rate(loop, 1e-5)
    _, long_sink = submit(loop, [1] * 600, 2)    # arrives first
    _, short_sink = submit(loop, [2] * 200, 2)
    finish(loop, engine, long_sink, short_sink)
    long_sink.wait()
    short_sink.wait()
    first = engine.plans_snapshot()[0]
    assert [lp.feed[0] for lp in first.lanes] == [2, 1]
    assert len(first.lanes[0].feed) == 200 and first.lanes[0].sample
    assert len(first.lanes[1].feed) == 56 and not first.lanes[1].sample
    assert first.prefill_tokens == 256
    assert engine.errors == []


def test_class_before_length_in_prefill_order(make):
    loop, engine = make(max_batch=4, prefill_budget=256, start=False)
    seed_prefill_rate(loop, 1e-5)
    _, a = submit(loop, [2] * 100, 2, qos="background")
    _, b = submit(loop, [1] * 600, 2, qos="agent")
    finish(loop, engine, a, b)
    a.wait()
    b.wait()
    first = engine.plans_snapshot()[0]
    assert [(lp.feed[0], len(lp.feed)) for lp in first.lanes] == [(1, 256)]


def test_finishing_urgent_prompt_prefills_nothing_lower_beside_it(make):
    loop, engine = make(max_batch=4, prefill_budget=4096, start=False)
    seed_prefill_rate(loop, 1e-5)
    _, agent = submit(loop, [2] * 200, 2, qos="agent")
    _, chat = submit(loop, [1] * 600, 2, qos="interactive")
    finish(loop, engine, agent, chat)
    agent.wait()
    chat.wait()
    first = engine.plans_snapshot()[0]
    assert [(lp.feed[0], len(lp.feed)) for lp in first.lanes] == [(1, 600)]
    agent_ticks = [i for i, _ in lane_plans(engine, 2)]
    assert agent_ticks and agent_ticks[0] >= 1


def test_admitted_lane_prefill_not_starved_beyond_bound(make):
    loop, engine = make(max_batch=2, prefill_budget=256, starvation_ticks=3, start=False)
    seed_prefill_rate(loop, 1e-5)
    _, agent = submit(loop, [1] * 3000, 1, qos="agent")
    _, bg = submit(loop, [2] * 300, 1, qos="background")
    finish(loop, engine, agent, bg)
    agent.wait()
    bg.wait()
    bg_ticks = [i for i, _ in lane_plans(engine, 2)]
    assert bg_ticks[0] <= 3 + 1, f"background lane first prefilled at tick {bg_ticks[0]}"


def test_equal_class_agents_prefill_in_turn(make):
    """Eight agents of one class with equal prompts: the one that has started keeps the budget
    until its first token (shortest remaining first), so each agent's prompt is fed in one run of
    ticks, and none starts before the one before it finished: one-at-a-time first tokens."""
    loop, engine = make(max_batch=8, prefill_budget=256, starvation_ticks=3, start=False)
    seed_prefill_rate(loop, 1e-5)
    sinks = [submit(loop, [i + 1] * 1000, 1, qos="agent")[1] for i in range(8)]
    finish(loop, engine, *sinks)
    spans = []
    for i in range(8):
        ticks = [t for t, _ in lane_plans(engine, i + 1)]
        assert ticks == list(range(ticks[0], ticks[0] + len(ticks))), f"agent {i} interrupted: {ticks}"
        spans.append((ticks[0], ticks[-1]))
    spans.sort()
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), spans  # the rest of a tick goes to the next
    assert engine.errors == []


def test_newer_shorter_lanes_do_not_starve_an_older_long_prompt(make):
    """Shortest remaining first would feed a stream of short prompts ahead of a long one forever;
    a lane passed over by lanes admitted after it starves after --starvation-ticks and is fed next."""
    loop, engine = make(max_batch=8, prefill_budget=128, starvation_ticks=2, start=False)
    seed_prefill_rate(loop, 1e-5)
    _, long_sink = submit(loop, [1] * 2000, 1, qos="agent")
    step(loop, engine)  # the long prompt is admitted (and fed) alone: the shorts come after it
    shorts = []
    for i in range(6):  # a stream: each short arrives in a tick of its own
        shorts.append(submit(loop, [i + 2] * 120, 1, qos="agent")[1])
        step(loop, engine)
    finish(loop, engine, long_sink, *shorts)
    long_ticks = [t for t, _ in lane_plans(engine, 1)]
    short_ticks = sorted(t for i in range(6) for t, _ in lane_plans(engine, i + 2))
    # after its first chunk the long prompt waits behind the newer shorts at most the bound
    resumed = long_ticks[1]
    assert resumed < short_ticks[-1], (long_ticks, short_ticks)  # fed before the shorts all ran
    assert resumed - long_ticks[0] <= 2 + 2, (long_ticks, short_ticks)


def test_lanes_admitted_together_take_turns_without_starving(make):
    """Agents admitted in one pass are a fixed set: the last to arrive, with the shortest prompt
    (a requeued lane, or one a cached prefix seeded), is fed first, and the others wait their turn
    without starving: were they counted as passed over, each would get a chunk every
    --starvation-ticks in turn, and every agent's first token would come late."""
    loop, engine = make(max_batch=8, prefill_budget=256, starvation_ticks=3, start=False)
    seed_prefill_rate(loop, 1e-5)
    sinks = [submit(loop, [i + 1] * 1000, 1, qos="agent")[1] for i in range(7)]
    sinks.append(submit(loop, [8] * 900, 1, qos="agent")[1])   # arrived last, shortest
    finish(loop, engine, *sinks)
    spans = []
    for i in range(8):
        ticks = [t for t, _ in lane_plans(engine, i + 1)]
        assert ticks == list(range(ticks[0], ticks[0] + len(ticks))), f"agent {i} interrupted: {ticks}"
        spans.append((ticks[0], ticks[-1], i))
    spans.sort()
    assert spans[0][2] == 7, spans   # the shortest went first
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), spans
    assert engine.errors == []


# ---- admission order --------------------------------------------------------------------------------

def test_admission_follows_class_priority_fifo_within_class(make):
    loop, engine = make(FakeEngine(max_lanes=1), max_batch=1, starvation_ticks=100000, start=False)
    log: list[tuple[str, str]] = []
    order = [("bg1", "background"), ("ag1", "agent"), ("bg2", "background"),
             ("in1", "interactive"), ("ag2", "agent"), ("in2", "interactive"),
             ("co1", "completion")]
    ids = {}
    sinks = []
    for name, cls in order:
        req, sink = submit(loop, [len(ids) + 1, 50], 2, qos=cls, log=log)
        ids[req.id] = name
        sinks.append(sink)
    finish(loop, engine, *sinks)
    for sink in sinks:
        assert sink.wait().finish_reason == "length"
    admitted = [ids[rid] for kind, rid in log if kind == "admitted"]
    assert admitted == ["in1", "in2", "co1", "ag1", "ag2", "bg1", "bg2"]
    # One lane at a time: each finished before the next was admitted.
    seq = [(kind, ids[rid]) for kind, rid in log if kind in ("admitted", "finished")]
    assert seq == [(k, n) for n in admitted for k in ("admitted", "finished")]
    assert engine.errors == []


def test_class_lane_cap(make):
    loop, engine = make(max_batch=3, start=False, extra={"class-lanes": {"background": 1}})
    log: list[tuple[str, str]] = []
    bg_ids = {submit(loop, [10 + i], 2, qos="background", log=log)[0].id for i in range(3)}
    submit(loop, [20], 2, qos="agent", log=log)
    drive(loop, engine, lambda: sum(1 for kind, _ in log if kind == "finished") == 4)
    first = engine.plans_snapshot()[0]
    assert sorted(lp.feed[0] for lp in first.lanes) == [10, 20]   # a free lane stays free
    running = peak = 0
    for kind, rid in log:
        if rid in bg_ids and kind in ("admitted", "finished"):
            running += 1 if kind == "admitted" else -1
            peak = max(peak, running)
    assert peak == 1


# ---- streamed tokens --------------------------------------------------------------------------------

def test_delta_token_ids_exclude_tokens_past_the_end(make):
    loop, engine = make(FakeEngine(max_lanes=2, eog=12), max_batch=2, start=False)
    loop.scheduler.costs.observe([StepTiming(prefill_tokens=0, decode_tokens=1, seconds=1e-4)])
    # decode is cheap, so one tick samples many tokens
    _, stop_sink = submit(loop, [5], 10, stop=("<8>",))
    _, eog_sink = submit(loop, [5], 10)
    finish(loop, engine, stop_sink, eog_sink)
    assert stop_sink.wait().finish_reason == "stop"
    assert eog_sink.wait().finish_reason == "stop"
    assert eog_sink.text == "<6><7><8><9><10><11>"
    assert eog_sink.token_ids == [6, 7, 8, 9, 10, 11]     # actual: ... 11, 12 (the eog token)
    assert stop_sink.token_ids == [6, 7, 8]               # actual: 6 .. 12 (past the stop)


def test_delta_token_ids_include_tokens_without_released_text(make):
    loop, engine = make(max_batch=2, tick_decode_budget=1, start=False)   # one token per tick
    _, sink = submit(loop, [5], 10, stop=("<8>",))
    finish(loop, engine, sink)
    fin = sink.wait()
    assert fin.finish_reason == "stop" and sink.text == "<6><7>"
    assert len(sink.token_ids) == fin.completion_tokens  # actual: [6, 7] vs 3
