"""The model loop on its own thread (core/loop.py): requests submitted from the test's thread
complete, stop, are cancelled or fail as a front end would see them, and a tick in flight is
asked to stop or yield. The real scheduler and the default policies (plugins/qos) drive the fake
engine of ``fakes.py``; its ``block()`` holds a tick so a test can act while it is in flight."""

from __future__ import annotations

import threading

import pytest

from superfluid.core.errors import ContextLengthExceeded, ServiceUnavailable, SuperfluidError

from .fakes import WAIT, FakeEngine, expected_tokens, render, submit, wait_for


# ---- completion -------------------------------------------------------------------------------------

def test_requests_complete_with_length(make):
    loop, engine = make(max_batch=4)
    jobs = [([1, 2, 3], 5), ([10, 11], 1), ([500], 7), ([998], 4)]
    sinks = [submit(loop, prompt, n)[1] for prompt, n in jobs]
    for (prompt, n), sink in zip(jobs, sinks):
        fin = sink.wait()
        assert fin.kind == "finished"
        assert fin.finish_reason == "length"
        assert fin.completion_tokens == n
        assert fin.prompt_tokens == len(prompt)
        want = expected_tokens(prompt[-1], n)
        assert sink.token_ids == want
        assert sink.text == render(want)
        assert sink.kinds()[0] == "admitted"
        assert fin.timings["prefilled"] == len(prompt)
    assert engine.errors == []


def test_wraps_token_ids_mod_1000(make):
    loop, _ = make()
    _, sink = submit(loop, [998], 4)
    sink.wait()
    assert sink.text == "<999><0><1><2>"


def test_eog_ends_with_stop_and_is_not_counted(make):
    loop, engine = make(FakeEngine(max_lanes=2, eog=9), max_batch=2)
    _, sink = submit(loop, [5], 10)
    fin = sink.wait()
    assert fin.finish_reason == "stop"
    assert fin.completion_tokens == 3          # <6><7><8>; the eog token 9 is not counted
    assert sink.text == "<6><7><8>"
    assert engine.errors == []


def test_eog_as_first_token(make):
    loop, _ = make(FakeEngine(max_lanes=2, eog=9), max_batch=2)
    _, sink = submit(loop, [8], 10)
    fin = sink.wait()
    assert fin.finish_reason == "stop"
    assert fin.completion_tokens == 0
    assert sink.text == ""


def test_ignore_eos_runs_to_length(make):
    loop, _ = make(FakeEngine(max_lanes=2, eog=9), max_batch=2)
    _, sink = submit(loop, [5], 6, ignore_eos=True)
    fin = sink.wait()
    assert fin.finish_reason == "length"
    assert fin.completion_tokens == 6
    assert sink.text == render(range(6, 12))


def test_stop_string_ends_with_stop(make):
    loop, _ = make()
    _, sink = submit(loop, [5], 10, stop=("<8>",))
    fin = sink.wait()
    assert fin.finish_reason == "stop"
    assert sink.text == "<6><7>"


def test_context_length_exceeded(make):
    loop, _ = make(FakeEngine(max_lanes=2, context_length=64), max_batch=2)
    for n in (64, 65, 200):
        with pytest.raises(ContextLengthExceeded) as exc:
            submit(loop, [1] * n, 4)
        assert exc.value.code == "context_length_exceeded"
        assert exc.value.status == 400
    assert loop.snapshot()["queued"] == 0
    with pytest.raises(SuperfluidError):
        submit(loop, [], 4)


def test_generation_stops_at_the_context_window(make):
    loop, engine = make(FakeEngine(max_lanes=2, context_length=64), max_batch=2)
    _, sink = submit(loop, [1] * 60, 100)
    fin = sink.wait()
    assert fin.finish_reason == "length"
    assert fin.completion_tokens == 4      # 60 + 4 = the 64-token window
    _, sink = submit(loop, [1] * 63, 100)
    fin = sink.wait()
    assert fin.finish_reason == "length"
    assert fin.completion_tokens == 1
    assert engine.errors == []


# ---- snapshot ---------------------------------------------------------------------------------------

def test_snapshot_slots_free_after_completion(make):
    loop, engine = make(max_batch=3, name="fake-test")
    sinks = [submit(loop, [7, 8, 9], 3)[1] for _ in range(4)]
    for sink in sinks:
        sink.wait()
    snap = loop.snapshot()
    assert snap["model"] == "fake-test"
    assert [s["state"] for s in snap["slots"]] == ["free"] * 3
    assert [s["id"] for s in snap["slots"]] == [0, 1, 2]
    assert snap["queued"] == 0 and snap["queue"] == []
    assert snap["ticks"] >= 1
    assert not loop.busy()


def test_snapshot_shows_busy_slot_during_tick(make):
    loop, engine = make(max_batch=2)
    engine.block()
    req, sink = submit(loop, [1, 2, 3], 2, qos="background")
    assert engine.holding.wait(WAIT)
    snap = loop.snapshot()
    busy = [s for s in snap["slots"] if s["state"] != "free"]
    assert len(busy) == 1
    assert busy[0]["request_id"] == req.id
    assert busy[0]["state"] == "prefilling"
    assert busy[0]["qos"] == "background"
    assert busy[0]["prompt_tokens"] == 3
    engine.unblock()
    sink.wait()
    assert all(s["state"] == "free" for s in loop.snapshot()["slots"])


# ---- stop and yield ---------------------------------------------------------------------------------

def test_urgent_arrival_asks_the_running_tick_to_stop(make):
    loop, engine = make(max_batch=2)
    engine.block()
    _, bg = submit(loop, [1, 2], 3, qos="background")
    assert engine.holding.wait(WAIT)
    before = engine.stop_requests
    _, ag = submit(loop, [3, 4], 3, qos="agent")
    assert engine.stop_requests == before          # an agent does not interrupt
    _, chat = submit(loop, [5, 6], 3, qos="interactive")
    assert engine.stop_requests == before + 1      # interactive work does
    engine.unblock()
    for sink in (bg, ag, chat):
        assert sink.wait().finish_reason == "length"
    assert bg.token_ids == expected_tokens(2, 3)   # an early-stopped tick repeats nothing
    assert engine.errors == []


@pytest.mark.parametrize("watched", [False, True])
def test_a_quiet_tick_yields_to_any_newcomer(make, watched):
    """A reply sent whole with no stop strings runs in quiet ticks (longer than the free-lane
    target); a newcomer of any class ends one after the step in flight instead of waiting for it.
    A streamed reply keeps short ticks, and an agent arriving waits for the tick in flight."""
    loop, engine = make(extra={"quiet-ticks": True})
    engine.block(after=1)                              # the prefill tick runs, the next is held
    _, first = submit(loop, [1, 2], 500, streamed=watched)
    assert engine.holding.wait(WAIT)
    held = engine.plans_snapshot()[-1]
    assert held.quiet is not watched
    _, second = submit(loop, [3, 4], 3, qos="agent")
    assert engine.yield_requests == (0 if watched else 1)
    assert engine.stop_requests == 0                  # a yield lets the step in flight finish
    engine.unblock()
    assert second.wait().finish_reason == "length"
    assert first.wait().finish_reason == "length"
    assert not engine.errors


# ---- cancel -----------------------------------------------------------------------------------------

def test_cancel_queued_request(make):
    loop, engine = make(FakeEngine(max_lanes=1), max_batch=1)
    engine.block()
    running, run_sink = submit(loop, [1, 2], 3)
    assert engine.holding.wait(WAIT)
    queued, q_sink = submit(loop, [3, 4], 3)
    assert loop.snapshot()["queued"] == 1
    loop.cancel(queued.id)
    assert q_sink.done.is_set()                     # answered at once, not at the next tick
    fin = q_sink.events[-1]
    assert q_sink.kinds() == ["finished"]
    assert fin.finish_reason == "cancelled"
    assert fin.completion_tokens == 0
    assert loop.snapshot()["queued"] == 0
    engine.unblock()
    assert run_sink.wait().finish_reason == "length"
    loop.cancel("no-such-request")                 # unknown ids are ignored
    assert engine.errors == []


def test_cancel_running_request_frees_its_slot(make):
    loop, engine = make(FakeEngine(max_lanes=1), max_batch=1)
    engine.block()
    running, run_sink = submit(loop, [1, 2], 500)
    assert engine.holding.wait(WAIT)
    slot = engine.plans_snapshot()[-1].lanes[0].slot
    _, next_sink = submit(loop, [7], 3)
    n_plans = len(engine.plans_snapshot())
    stops = engine.stop_requests
    loop.cancel(running.id)
    assert engine.stop_requests == stops + 1        # the tick in flight is asked to end
    fin = run_sink.wait()
    assert fin.kind == "finished" and fin.finish_reason == "cancelled"
    assert engine.results[n_plans - 1].stopped_early
    engine.unblock()
    assert next_sink.wait().finish_reason == "length"
    assert next_sink.text == "<8><9><10>"
    later = engine.plans_snapshot()[n_plans:]
    assert slot in later[0].release                 # the next plan releases the cancelled slot
    assert [lp.slot for lp in later[0].lanes] == [slot]  # and the queued request takes it over
    assert later[0].lanes[0].reset
    assert all(s["state"] == "free" for s in loop.snapshot()["slots"])
    assert engine.errors == []


def test_cancel_running_request_alone_releases_slot(make):
    loop, engine = make(max_batch=2)
    engine.block()
    running, sink = submit(loop, [1, 2], 500)
    assert engine.holding.wait(WAIT)
    slot = engine.plans_snapshot()[-1].lanes[0].slot
    loop.cancel(running.id)
    assert sink.wait().finish_reason == "cancelled"
    assert wait_for(lambda: any(slot in p.release for p in engine.plans_snapshot()))
    release_plan = next(p for p in engine.plans_snapshot() if slot in p.release)
    assert release_plan.lanes == []
    assert all(s["state"] == "free" for s in loop.snapshot()["slots"])
    assert engine.errors == []


# ---- shutdown and robustness ------------------------------------------------------------------------

def test_close_fails_queued_requests(make):
    loop, engine = make(FakeEngine(max_lanes=1), max_batch=1)
    engine.block()
    _, running = submit(loop, [1], 2)
    assert engine.holding.wait(WAIT)
    _, queued = submit(loop, [2], 2)
    closer = threading.Thread(target=loop.close, kwargs={"timeout": WAIT})
    closer.start()
    ev = queued.wait()                                # failed at once, while the tick is held
    assert ev.kind == "error" and isinstance(ev.error, ServiceUnavailable)
    assert not running.done.is_set()
    engine.unblock()
    closer.join(WAIT)
    assert not closer.is_alive()
    assert running.wait().finish_reason == "length"   # a running lane is drained
    assert running.token_ids == [2, 3]
    with pytest.raises(ServiceUnavailable):
        submit(loop, [3], 2)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_hook_failure_does_not_hang_the_model(make):
    loop, engine = make(max_batch=2, start=False)
    _, bad = submit(loop, [1], 2, qos="no-such-class")
    loop.start()
    assert bad.done.wait(1.0), "the request with a bad class was never answered"
    _, good = submit(loop, [2], 2)
    assert good.done.wait(1.0), "the model stopped serving"


def test_what_the_model_cannot_serve_is_refused_on_submit(make):
    """Fake engine: a constraint llguidance cannot enforce, an embedding from an engine with none,
    a generation from an embedding-only model: 400s before anything is queued, the one check
    every front end gets (the HTTP front end repeats none of it), worded as clients read it."""
    pytest.importorskip("llguidance")
    import attrs

    from superfluid.core.errors import InvalidRequest
    from superfluid.core.request import JsonChoice, JsonConstraint, Request, SamplingParams

    loop, engine = make()
    bad = SamplingParams(json_schema=JsonConstraint(choices=(JsonChoice("", {"type": "string", "format": "nope"}),)))
    cases = [(Request(prompt_tokens=[1, 2], max_tokens=2, sink=lambda e: None, sampling=bad,
                      meta={"constraint_param": field}), "unsupported_schema", field,
              f"{field}: this schema cannot be enforced: ") for field in ("tools", "response_format")]
    cases += [(Request(prompt_tokens=[1, 2], max_tokens=1, sink=lambda e: None, embed=True),
               "embeddings_not_supported", "model", f"model {loop.name!r} does not serve embeddings")]
    for req, code, param, message in cases:
        with pytest.raises(InvalidRequest) as info:
            loop.submit(req)
        err = info.value
        assert (err.status, err.code, err.param) == (400, code, param)
        assert err.message.startswith(message) and "\n" not in err.message, err.message
        assert code != "unsupported_schema" or "nope" in err.message  # llguidance's reason names it
    engine.capabilities = attrs.evolve(engine.capabilities, generates=False)
    with pytest.raises(InvalidRequest) as info:
        loop.submit(Request(prompt_tokens=[1, 2], max_tokens=2, sink=lambda e: None))
    assert (info.value.code, info.value.param, info.value.message) == (
        "model_not_generative", "model", f"model {loop.name!r} is embedding-only (embedding-only = true): use "
        "/v1/embeddings")
    assert not loop.scheduler.queue and not loop.scheduler.lanes
