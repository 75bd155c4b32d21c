"""Lanes grouped by LoRA adapter set on an engine that runs one set per tick (llama.cpp, MLX),
with the real scheduler and the default policy (plugins/qos/groups.py) driving a FAKE engine
(tests/unit/fake_lora.py): each plan holds one set, equal groups alternate, no group with lanes
waits more than --starvation-ticks, QoS and preemption still apply across groups; a per_row
engine (basert) gets mixed sets in one plan."""

from __future__ import annotations

from .fake_lora import FakeLoraEngine, expected_under, load_stepped
from .fakes import drive, submit

A, B = (("a", 1.0),), (("b", 1.0),)


def _sets(plans):
    """The adapter set each plan with lanes ran (asserting one per plan)."""
    out = []
    for plan in plans:
        sets = {lp.adapters for lp in plan.lanes}
        if sets:
            assert len(sets) == 1, sets
            out.append(sets.pop())
    return out


def _run(loop, engine, jobs):
    sinks = [(submit(loop, p, n, adapters=s, qos=q)[1], p, n, s) for p, n, s, q in jobs]
    drive(loop, engine, lambda: all(k.done.is_set() for k, *_ in sinks), max_ticks=2000)
    for sink, p, n, s in sinks:
        assert sink.wait().finish_reason == "length"
        assert sink.token_ids == expected_under(p, n, s), s
    return sinks


def test_each_tick_runs_one_adapter_set_and_every_reply_is_its_own(make, tmp_path):
    engine = FakeLoraEngine(max_lanes=6)
    loop, engine = make(engine, max_batch=6, start=False)
    load_stepped(loop, engine, tmp_path, "a", "b")
    jobs = [([10 + i] * 20, 6, s, "agent") for i, s in enumerate([(), A, B, (), A, B])]
    _run(loop, engine, jobs)
    assert engine.errors == []
    assert set(_sets(engine.plans_snapshot())) == {(), A, B}


def test_equal_groups_take_turns(make, tmp_path):
    engine = FakeLoraEngine(max_lanes=4)
    loop, engine = make(engine, max_batch=4, start=False, starvation_ticks=8, tick_decode_budget=2)
    load_stepped(loop, engine, tmp_path, "a")
    _run(loop, engine, [([1] * 8, 40, (), "agent"), ([2] * 8, 40, A, "agent")])
    sets = _sets(engine.plans_snapshot())
    both = sets[:sets.index(A) + 20]  # while both groups have lanes
    assert all(x != y for x, y in zip(both[2:], both[3:])), both  # alternating tick by tick
    assert engine.errors == []


def test_a_lower_class_group_runs_within_the_starvation_bound(make, tmp_path):
    bound = 4
    engine = FakeLoraEngine(max_lanes=4)
    # two tokens a tick, so each lane needs many ticks
    loop, engine = make(engine, max_batch=4, start=False, starvation_ticks=bound, tick_decode_budget=2)
    load_stepped(loop, engine, tmp_path, "a")
    # an interactive lane under the base model generates long; a background one under "a"
    _run(loop, engine, [([1] * 8, 200, (), "interactive"), ([2] * 8, 20, A, "background")])
    sets = _sets(engine.plans_snapshot())
    last_a = max(i for i, s in enumerate(sets) if s == A)
    gaps, since = [], 0
    for s in sets[:last_a + 1]:
        since = 0 if s == A else since + 1
        gaps.append(since)
    assert max(gaps) <= bound, gaps  # "a" never waited more than --starvation-ticks
    assert sets.count(()) > sets[:last_a].count(A)  # the interactive group still ran most ticks
    assert engine.errors == []


def test_the_most_urgent_group_goes_first(make, tmp_path):
    engine = FakeLoraEngine(max_lanes=4)
    loop, engine = make(engine, max_batch=4, start=False, starvation_ticks=50)
    load_stepped(loop, engine, tmp_path, "a")
    _, slow = submit(loop, [3] * 8, 30, adapters=(), qos="background")
    for _ in range(3):
        loop.step()
    n = len(engine.plans_snapshot())
    _, chat = submit(loop, [4] * 8, 5, adapters=A, qos="interactive")
    drive(loop, engine, chat.done.is_set)
    sets = _sets(engine.plans_snapshot()[n:])
    assert sets and set(sets) == {A}  # the chat's group ran every tick until it finished
    assert chat.token_ids == expected_under([4] * 8, 5, A)
    drive(loop, engine, slow.done.is_set)
    assert slow.token_ids == expected_under([3] * 8, 30, ())
    assert engine.errors == []


def test_preemption_crosses_groups(make, tmp_path):
    engine = FakeLoraEngine(max_lanes=2)
    loop, engine = make(engine, max_batch=2, start=False)
    load_stepped(loop, engine, tmp_path, "a", "b")
    _, bg1 = submit(loop, [5] * 8, 1500, adapters=A, qos="background")
    _, bg2 = submit(loop, [6] * 8, 1500, adapters=A, qos="background")
    for _ in range(3):
        loop.step()
    _, chat = submit(loop, [7] * 8, 4, adapters=B, qos="interactive")
    loop.step()
    assert any(e.kind == "paused" for e in bg1.events + bg2.events)  # a lane under "a" made room
    drive(loop, engine, lambda: all(s.done.is_set() for s in (bg1, bg2, chat)), max_ticks=2000)
    assert chat.token_ids == expected_under([7] * 8, 4, B)
    assert bg1.token_ids == expected_under([5] * 8, 1500, A)  # resumed, nothing lost or repeated
    assert bg2.token_ids == expected_under([6] * 8, 1500, A)
    assert engine.errors == []


def test_per_row_engine_mixes_sets_in_one_tick(make, tmp_path):
    engine = FakeLoraEngine(max_lanes=4, adapters="per_row")
    loop, engine = make(engine, max_batch=4, start=False)
    load_stepped(loop, engine, tmp_path, "a", "b")
    sinks = [submit(loop, [20 + i] * 8, 5, adapters=s)[1] for i, s in enumerate([(), A, B])]
    drive(loop, engine, lambda: all(s.done.is_set() for s in sinks))
    assert max(len({lp.adapters for lp in p.lanes}) for p in engine.plans_snapshot()) == 3
    for i, (sink, s) in enumerate(zip(sinks, [(), A, B])):
        assert sink.token_ids == expected_under([20 + i] * 8, 5, s)
    assert engine.errors == []
