"""OS memory pressure (spec: scheduling-and-qos.md, "Memory pressure"): what the KV manager and
the scheduler do when a pressure source reports "warning" or "critical": the host tier is
dropped and stays closed for a while, cached prefixes are evicted, background lanes decoding
are preempted at "critical", and a broken source does not stop the model.

The loop runs on the fake engine with a prefix cache (``fakes.py``), whose sampler hashes the
slot's whole KV: every output is compared with the cold one, ``expected()``. It is stepped
through ``ModelLoop.step()`` (``stepped``: pressure is read at every tick and the scheduler's clock
moves only when the test advances it), so which tick sees the pressure is deterministic; the
broken source is read on the loop's own thread, which must survive it."""

from __future__ import annotations

import threading

import superfluid.core.kv as kv_mod

from .fakes import RaisingSource, drive, expected, prompt, run_stepped, step, submit, wait_for


def fill(loop, engine, prompts, max_tokens=1):
    """Run each prompt in turn; the slot each was cached in."""
    return [run_stepped(loop, engine, p, max_tokens)[1].slot for p in prompts]


# ---- warning ----------------------------------------------------------------------------------------

def test_warning_evicts_every_prefix_and_drops_host_memory(stepped):
    loop, engine, source, clock = stepped(max_batch=4, host_cache_bytes=1 << 20)
    P = [prompt(100 * k, 80) for k in range(10)]
    slots = fill(loop, engine, P[1:5])                  # four slots cached
    _, lp, _ = run_stepped(loop, engine, P[5], 1)       # evicts P1 (LRU) to host memory
    assert lp.slot == slots[0] and len(loop.scheduler.kv.host) == 1
    assert [pk for plan in engine.plans for pk in plan.park] == [(slots[0], "prefix-1")]
    assert "prefix-1" in engine.parked

    source.value = "warning"
    _, sink6 = submit(loop, P[6], 3)
    plan, stats = step(loop, engine)                    # P6 evicts P2 to host, then the warning is read
    assert plan.park == [(slots[1], "prefix-2")]
    assert stats.pressure == "warning"
    assert stats.host_entries == 0 and stats.host_bytes == 0 and stats.cached_tokens == 0
    assert "os_pressure" in stats.evictions
    source.value = "ok"
    plan, stats = step(loop, engine)
    assert plan.drop_parked == ["prefix-1", "prefix-2"]
    assert plan.release == [slots[2], slots[3], slots[0]]   # P3, P4, P5: every cached prefix, LRU order
    assert plan.park == []
    assert engine.parked == {}
    assert loop.scheduler.pressure == "ok"
    drive(loop, engine, sink6.done.is_set)
    assert sink6.token_ids == expected(P[6], 3) and "paused" not in sink6.kinds()

    # For a while nothing moves to host memory: slot reuse evicts without parking.
    n0 = len(engine.plans)
    fill(loop, engine, P[7:10] + [P[1], P[2]])
    assert not any(plan.park for plan in engine.plans[n0:])
    assert not any(lp.seed.key for plan in engine.plans[n0:] for lp in plan.lanes)   # host entries gone
    # After the pause (30 s on the scheduler's clock) the host tier is open again.
    clock.advance(kv_mod.HOST_PAUSE_S + 1)
    n0 = len(engine.plans)
    run_stepped(loop, engine, P[3], 1)
    assert [pk for plan in engine.plans[n0:] for pk in plan.park] == [(engine.plans[n0].lanes[0].slot, "prefix-3")]
    assert engine.errors == []


def test_warning_and_pause_also_stop_watermark_parking(stepped):
    """Capacity 400, high 85 %, low 70 %, 1 MiB of host memory: after a warning, watermark
    evictions release prefixes without moving them to host memory."""
    loop, engine, source, clock = stepped(max_batch=4, kv_capacity=400, host_cache_bytes=1 << 20)
    fill(loop, engine, [prompt(100, 70)])
    source.value = "warning"
    _, _, stats = run_stepped(loop, engine, prompt(300, 70), 1)   # a warning round empties the cache
    assert stats[-1].pressure == "warning" and stats[-1].cached_tokens == 0
    source.value = "ok"
    n0 = len(engine.plans)
    c, d, e = fill(loop, engine, [prompt(500, 100), prompt(700, 100), prompt(900, 100)])   # 300 / 400
    _, lp, stats = run_stepped(loop, engine, prompt(50, 100), 1)   # 400 / 400: evict C, D
    assert stats[-1].evictions == {"watermark": 2} and stats[-1].kv_used == 400
    plan, _ = step(loop, engine)
    assert plan.release == [c, d] and plan.park == []               # host memory still closed
    assert not any(plan.park for plan in engine.plans[n0:])
    assert len(loop.scheduler.kv.host) == 0 and engine.parked == {}
    assert engine.errors == []


def test_no_parking_in_the_tick_that_sees_os_pressure(stepped):
    loop, engine, source, clock = stepped(max_batch=4, kv_capacity=400, host_cache_bytes=1 << 20,
                                          pressure_high=0.85, pressure_low=0.70)
    fill(loop, engine, [prompt(100, 90), prompt(300, 90), prompt(500, 90)])   # 270 / 400
    source.value = "warning"
    submit(loop, prompt(700, 110), 3)
    _, stats = step(loop, engine)       # 380 / 400: the watermark and the warning in one commit
    assert stats.pressure == "warning"
    plan, _ = step(loop, engine)
    assert plan.park == []


# ---- critical ---------------------------------------------------------------------------------------

def test_critical_preempts_decoding_background_lanes_only(stepped):
    loop, engine, source, clock = stepped(max_batch=4, host_cache_bytes=1 << 20, park=True,
                                          tick_decode_budget=3, prefill_budget=64)
    bg_p, ag_p, bgp_p = prompt(100, 40), prompt(300, 40), prompt(500, 700)
    bg, bg_sink = submit(loop, bg_p, 12, qos="background")
    ag, ag_sink = submit(loop, ag_p, 12, qos="agent")
    bgp, bgp_sink = submit(loop, bgp_p, 3, qos="background")

    def state(req):
        for s in loop.snapshot()["slots"]:
            if s.get("request_id") == req.id:
                return s["state"]
        return None

    drive(loop, engine, lambda: state(bg) == "decoding" and state(ag) == "decoding")
    assert state(bgp) == "prefilling"

    source.value = "warning"                              # a warning preempts nothing
    _, stats = step(loop, engine)
    assert stats.pressure == "warning" and stats.preempted == 0
    assert state(bg) == "decoding" and state(ag) == "decoding" and state(bgp) == "prefilling"

    source.value = "critical"
    bg_slot = next(s["id"] for s in loop.snapshot()["slots"] if s.get("request_id") == bg.id)
    _, stats = step(loop, engine)
    assert stats.pressure == "critical" and stats.preempted == 1
    assert "paused" in bg_sink.kinds()
    assert "paused" not in ag_sink.kinds() and "paused" not in bgp_sink.kinds()
    assert state(ag) == "decoding" and state(bgp) == "prefilling"
    source.value = "ok"
    plan, _ = step(loop, engine)
    assert bg_slot in plan.release
    assert plan.park == []                                # --park, but host memory is closed
    drive(loop, engine, lambda: bg_sink.done.is_set() and ag_sink.done.is_set() and bgp_sink.done.is_set())
    assert bg_sink.token_ids == expected(bg_p, 12)
    assert ag_sink.token_ids == expected(ag_p, 12)
    assert bgp_sink.token_ids == expected(bgp_p, 3)
    assert not any(plan.park for plan in engine.plans)
    assert not any(lp.seed.key for plan in engine.plans for lp in plan.lanes)
    assert engine.errors == []


# ---- a broken source --------------------------------------------------------------------------------

def test_a_failing_pressure_source_does_not_stop_the_model(make, monkeypatch):
    died = []
    monkeypatch.setattr(threading, "excepthook", died.append)   # the model's thread's uncaught exception
    loop, engine = make(sources=[RaisingSource()], prefix_cache=True)
    _, sink = submit(loop, prompt(100, 20), 2)
    wait_for(lambda: sink.done.is_set() or not loop.running)
    assert loop.running, f"model thread died: {[repr(a.exc_value) for a in died]}"
    assert sink.done.is_set() and sink.events[-1].kind == "finished"
