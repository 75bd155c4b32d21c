"""KV watermarks: at --pressure-high occupancy the KV manager evicts cached prefixes, least
recently used first and pinned (--pin-prompt) ones last, down to --pressure-low; live lanes are
never evicted. The loop runs on the fake engine with a prefix cache and a small ``kv_capacity``
(``fakes.py``); ``observer`` collects each tick's TickStats."""

from __future__ import annotations

import pytest

from superfluid.core.cli import load
from superfluid.core.errors import ConfigError
from superfluid.core.tick import TickPlan

from .fakes import FakeEngine, cached_by_slot, expected, prompt, run_threaded, submit, wait_for


def test_watermarks_evict_lru_prefixes_down_to_low_with_hysteresis(make, observer):
    """Capacity 400 cells, high 85 % (340), low 70 % (280)."""
    engine = FakeEngine(max_lanes=4, kv_capacity=400, prefix_cache=True)
    loop, engine = make(engine, pressure_high=0.85, pressure_low=0.70)
    A, B, C = prompt(100, 90), prompt(300, 90), prompt(500, 90)
    slot = {}
    for name, p in (("A", A), ("B", B), ("C", C)):
        slot[name] = run_threaded(loop, engine, p, 1)[1].slot
    _, lp = run_threaded(loop, engine, A, 1)            # A used again: LRU order is now B, C, A
    assert lp.slot == slot["A"] and lp.pos == 89
    assert not any(plan.release for plan in engine.plans_snapshot())   # 270 / 400 < 85 %

    n0 = len(engine.plans_snapshot())
    _, lp = run_threaded(loop, engine, prompt(700, 110), 4)  # 380 / 400 >= 85 %: evict to <= 70 %
    slot["D"] = lp.slot
    releases = [plan.release for plan in engine.plans_snapshot()[n0:] if plan.release]
    assert releases == [[slot["B"], slot["C"]]]          # LRU first, and only down to 200 / 400
    assert cached_by_slot(loop) == {slot["A"]: 90, slot["B"]: 0, slot["C"]: 0, slot["D"]: 113}
    evicting = [s.evictions for s in observer.of(loop.name) if s.evictions]
    assert evicting == [{"watermark": 2}]

    n0 = len(engine.plans_snapshot())
    slot["E"] = run_threaded(loop, engine, prompt(850, 80), 1)[1].slot   # 283 / 400: above low, below high
    assert not any(plan.release for plan in engine.plans_snapshot()[n0:])
    slot["F"] = run_threaded(loop, engine, prompt(50, 60), 1)[1].slot    # 343 / 400: evict A only
    assert wait_for(lambda: any(plan.release for plan in engine.plans_snapshot()[n0:]))
    releases = [plan.release for plan in engine.plans_snapshot()[n0:] if plan.release]
    assert releases == [[slot["A"]]]
    assert cached_by_slot(loop) == {slot["A"]: 0, slot["D"]: 113, slot["E"]: 80, slot["F"]: 60}
    assert [s.evictions for s in observer.of(loop.name) if s.evictions] == [{"watermark": 2}, {"watermark": 1}]
    assert engine.errors == []


def assert_no_live_slot_released(plans: list[TickPlan]) -> None:
    """After a slot is released, the next lane plan on it must start over (reset at pos 0, or a
    seed from elsewhere): a release never takes KV from under a running lane."""
    released: set[int] = set()
    for i, plan in enumerate(plans):
        for lp in plan.lanes:
            if lp.slot in released:
                assert lp.reset and lp.seed.slot != lp.slot, f"plan {i}: slot {lp.slot} reused without a reset"
                if lp.seed.slot is None and lp.seed.key is None:
                    assert lp.pos == 0, f"plan {i}: slot {lp.slot} seeded from its own released KV"
                released.discard(lp.slot)
        live = {lp.slot for lp in plan.lanes}
        released |= set(plan.release) - live


def test_watermarks_never_evict_live_lanes(make, observer):
    """Occupancy stays above the high watermark from live lanes alone: no live lane's slot is
    released, only prefixes cached by lanes that already finished."""
    engine = FakeEngine(max_lanes=4, kv_capacity=200, prefix_cache=True)
    loop, engine = make(engine, pressure_high=0.5, pressure_low=0.2, tick_decode_budget=2)
    reqs = [submit(loop, prompt(100 * k, 60), n) for k, n in ((1, 4), (2, 8), (3, 12))]
    for p, (_, s) in zip((1, 2, 3), reqs):
        s.wait()
        assert s.token_ids == expected(prompt(100 * p, 60), len(s.token_ids))
    plans = engine.plans_snapshot()
    assert len({lp.slot for plan in plans for lp in plan.lanes}) == 3
    assert_no_live_slot_released(plans)
    stats = observer.of(loop.name)
    assert all(s.kv_used / s.kv_capacity >= 0.5 for s in stats if s.lanes_busy == 3)
    assert sum(s.evictions.get("watermark", 0) for s in stats) <= 2     # only finished lanes' prefixes
    assert engine.errors == []


# ---- pinned prefixes --------------------------------------------------------------------------------

def test_watermarks_evict_pinned_prefixes_last(make):
    """Capacity 400, high 85 %, low 70 %: an unpinned newer cache goes before the older pinned one."""
    system = prompt(1000, 40)
    engine = FakeEngine(max_lanes=4, kv_capacity=400, prefix_cache=True)
    loop, engine = make(engine, pressure_high=0.85, pressure_low=0.70, pinned_tokens=[system])
    pinned_slot = run_threaded(loop, engine, system + prompt(100, 50), 1)[1].slot   # oldest, pinned
    other_slot = run_threaded(loop, engine, prompt(300, 90), 1)[1].slot            # newer, unpinned
    third_slot = run_threaded(loop, engine, prompt(500, 90), 1)[1].slot            # newest, unpinned
    n0 = len(engine.plans_snapshot())
    run_threaded(loop, engine, prompt(700, 110), 4)                               # over 85 %
    assert wait_for(lambda: any(plan.release for plan in engine.plans_snapshot()[n0:]))
    releases = [plan.release for plan in engine.plans_snapshot()[n0:] if plan.release]
    assert releases and pinned_slot not in releases[0]
    assert releases[0][0] == other_slot and third_slot in releases[0]
    assert cached_by_slot(loop)[pinned_slot] == 90
    assert engine.errors == []


def test_pin_prompt_option_from_flags_and_toml(tmp_path):
    config, _ = load(["serve", "--pin-prompt", "A", "--pin-prompt", "B"])
    assert config.models[0]["pin-prompt"] == ["A", "B"]
    toml = tmp_path / "c.toml"
    toml.write_text('pin-prompt = ["<|im_start|>system\\nBe brief.<|im_end|>\\n"]\n')
    config, _ = load(["serve", "--config", str(toml)])
    assert config.models[0]["pin-prompt"] == ["<|im_start|>system\nBe brief.<|im_end|>\n"]
    toml.write_text('pin-prompt = [""]\n')
    with pytest.raises(ConfigError, match="pin-prompt"):
        load(["serve", "--config", str(toml)])
