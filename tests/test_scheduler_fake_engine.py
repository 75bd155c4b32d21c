"""The real Scheduler and the real default policies (plugins/qos, loaded through the entry points)
driving a deterministic fake engine on real threads.

FakeEngine: token ``i`` renders as ``f"<{i}>"``; every sampled token is ``(last fed token + 1) %
1000``; an optional end-of-generation token ends a lane. It checks the plan contract (positions
contiguous per slot, resets, releases), records every plan, and reports small fake timings so the
cost model sees a chosen prefill rate. It can be held mid-tick (``engine.block()``) so a test can
act while a tick is in flight; ``request_stop`` and ``request_yield`` end a held tick, as a real
engine's next step would.
"""

from __future__ import annotations

import copy
import threading
import time

import pytest

from superfluid.core.engine import Engine, EngineCapabilities, ModelInfo
from superfluid.core.errors import ContextLengthExceeded, ServiceUnavailable, SuperfluidError
from superfluid.core.lane import LaneEvent
from superfluid.core.plugins import make_plugin_manager
from superfluid.core.request import Request, SamplingParams
from superfluid.core.loop import ModelLoop as Scheduler
from superfluid.core.settings import SchedulerSettings
from superfluid.core.tick import LaneResult, StepTiming, TickPlan, TickResult

WAIT = 5.0  # seconds: the most any single wait in these tests may take


# ---- the fake engine ----------------------------------------------------------------------------

class FakeEngine(Engine):
    def __init__(self, *, max_lanes: int = 8, context_length: int = 4096, eog: int | None = None,
                 prefill_s_per_token: float = 1e-5, decode_s_per_round: float = 1e-4):
        self.capabilities = EngineCapabilities(max_lanes=max_lanes, context_length=context_length)
        self.info = ModelInfo(name="fake", path="", n_vocab=1000, n_ctx_train=context_length)
        self.eog = eog
        self.prefill_rate = prefill_s_per_token
        self.decode_rate = decode_s_per_round
        self.plans: list[TickPlan] = []
        self.results: list[TickResult] = []
        self.errors: list[str] = []          # plan-contract violations seen
        self.kv: dict[int, list[int]] = {}   # slot -> tokens in its KV
        self.hold = threading.Event()        # cleared: ticks with lanes wait (see block())
        self.hold.set()
        self.hold_from = 0                   # the first tick a block() holds
        self.holding = threading.Event()     # set while a tick is held
        self.stop_requests = 0
        self.yield_requests = 0
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self.started = False
        self.closed = False

    # -- test controls --
    def block(self, after: int = 0) -> None:
        """Hold ticks with lanes, from the one ``after`` ticks from now on."""
        self.hold_from = len(self.plans) + after
        self.holding.clear()
        self.hold.clear()

    def unblock(self) -> None:
        self.hold.set()

    def plans_snapshot(self) -> list[TickPlan]:
        with self._lock:
            return list(self.plans)

    # -- Engine --
    def start(self, progress=None) -> None:
        self.started = True

    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = True) -> list[int]:
        return [ord(c) % 1000 for c in text]

    def token_bytes(self, token: int) -> bytes:
        return f"<{token}>".encode()

    def request_stop(self) -> None:
        self.stop_requests += 1
        self._stop.set()

    def request_yield(self) -> None:
        self.yield_requests += 1
        self._stop.set()

    def clear_stop(self) -> None:
        self._stop.clear()

    def close(self) -> None:
        self.closed = True

    def run_tick(self, plan: TickPlan) -> TickResult:
        with self._lock:
            self.plans.append(copy.deepcopy(plan))
        # Releases and resets first, like the llama.cpp runner.
        for slot in plan.release:
            self.kv.pop(slot, None)
        slots = [lp.slot for lp in plan.lanes]
        if len(slots) != len(set(slots)):
            self.errors.append(f"a slot twice in one plan: {slots}")
        if len(slots) > self.capabilities.max_lanes:
            self.errors.append(f"{len(slots)} lanes > {self.capabilities.max_lanes}")
        for lp in plan.lanes:
            if not 0 <= lp.slot < self.capabilities.max_lanes:
                self.errors.append(f"slot {lp.slot} out of range")
            if lp.reset:
                self.kv[lp.slot] = []
                if lp.sampling is None:
                    self.errors.append(f"slot {lp.slot}: reset without sampling params")
            elif lp.slot not in self.kv:
                self.errors.append(f"slot {lp.slot}: used without a reset")
                self.kv[lp.slot] = []
            if lp.pos != len(self.kv[lp.slot]):
                self.errors.append(f"slot {lp.slot}: pos {lp.pos} but KV holds {len(self.kv[lp.slot])}")
            if not lp.feed:
                self.errors.append(f"slot {lp.slot}: empty feed")
            if lp.sample and lp.max_new < 1:
                self.errors.append(f"slot {lp.slot}: sample with max_new {lp.max_new}")

        result = TickResult()
        if plan.lanes and not self.hold.is_set() and len(self.plans) > self.hold_from:
            self.holding.set()
            deadline = time.monotonic() + WAIT
            while not self.hold.is_set() and not self._stop.is_set():
                if time.monotonic() > deadline:
                    self.errors.append("held tick never released")
                    break
                time.sleep(0.002)
            if self._stop.is_set() and not self.hold.is_set():
                # Ended at the first step: nothing fed, nothing sampled.
                result.stopped_early = True
                for lp in plan.lanes:
                    result.lanes[lp.slot] = LaneResult(slot=lp.slot)
                return self._finish(result)

        prefill = sum(len(lp.feed) for lp in plan.lanes if not lp.decode)
        n_decode = sum(1 for lp in plan.lanes if lp.decode)
        first = prefill * self.prefill_rate + (self.decode_rate if n_decode else 0.0)
        rounds_active: list[int] = []  # lanes still sampling in decode round r (r >= 1)
        for lp in plan.lanes:
            kv = self.kv[lp.slot]
            kv.extend(lp.feed)
            res = LaneResult(slot=lp.slot, n_fed=len(lp.feed), n_prefill=0 if lp.decode else len(lp.feed))
            if lp.sample:
                for r in range(lp.max_new):
                    if r > 0:
                        kv.append(res.tokens[-1])
                        res.n_fed += 1
                        while len(rounds_active) < r:
                            rounds_active.append(0)
                        rounds_active[r - 1] += 1
                    token = (kv[-1] + 1) % 1000
                    res.tokens.append(token)
                    if token == self.eog and not lp.ignore_eos:
                        res.eog = True
                        break
            result.lanes[lp.slot] = res
        if plan.lanes:
            result.steps.append(StepTiming(prefill_tokens=prefill, decode_tokens=n_decode, seconds=first))
        for n in rounds_active:
            result.steps.append(StepTiming(prefill_tokens=0, decode_tokens=n, seconds=self.decode_rate))
        return self._finish(result)

    def _finish(self, result: TickResult) -> TickResult:
        result.seconds = sum(s.seconds for s in result.steps)
        result.kv_used = sum(len(v) for v in self.kv.values())
        result.kv_capacity = self.capabilities.max_lanes * self.capabilities.context_length
        with self._lock:
            self.results.append(result)
        return result


# ---- helpers ----------------------------------------------------------------------------------

class Sink:
    """Collects a request's events; ``done`` is set on "finished" or "error"."""

    def __init__(self, log: list | None = None):
        self.events: list[LaneEvent] = []
        self.done = threading.Event()
        self.log = log

    def __call__(self, event: LaneEvent) -> None:
        self.events.append(event)
        if self.log is not None:
            self.log.append((event.kind, event.request_id))
        if event.kind in ("finished", "error"):
            self.done.set()

    def wait(self) -> LaneEvent:
        assert self.done.wait(WAIT), f"no finished event; got {[e.kind for e in self.events]}"
        return self.events[-1]

    @property
    def text(self) -> str:
        return "".join(e.text for e in self.events if e.kind == "delta")

    @property
    def token_ids(self) -> list[int]:
        return [t for e in self.events if e.kind == "delta" for t in e.token_ids]

    def kinds(self) -> list[str]:
        return [e.kind for e in self.events]


def render(tokens) -> str:
    return "".join(f"<{t}>" for t in tokens)


def expected_tokens(last_prompt_token: int, n: int) -> list[int]:
    return [(last_prompt_token + i) % 1000 for i in range(1, n + 1)]


def wait_for(predicate, timeout: float = WAIT) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.002)
    return predicate()


def _typed(extra, overrides):
    """Typed settings from the old string keys (temporary shim)."""
    extra = dict(extra or {})
    names = {"park": "park", "pressure-high": "pressure_high", "pressure-low": "pressure_low",
             "pinned-tokens": "pinned_tokens"}
    for key, field in names.items():
        if key in extra:
            overrides[field] = extra.pop(key)
    if "host-cache-mb" in extra:
        overrides["host_cache_bytes"] = extra.pop("host-cache-mb") << 20
    return extra


@pytest.fixture(scope="module")
def pm():
    manager = make_plugin_manager()
    assert manager.has_plugin("qos")
    return manager


@pytest.fixture
def make(pm):
    """make(engine=None, **settings) -> (scheduler, engine); every scheduler is closed afterwards."""
    made: list[tuple[Scheduler, FakeEngine]] = []

    def factory(engine: FakeEngine | None = None, *, start: bool = True, **overrides):
        max_batch = overrides.pop("max_batch", 4)
        engine = engine or FakeEngine(max_lanes=max_batch)
        extra = _typed(overrides.pop("extra", None), overrides)
        settings = SchedulerSettings(max_batch=max_batch,
                                     context_length=engine.capabilities.context_length, extra=extra, **overrides)
        sched = Scheduler("fake-test", engine, pm.hook, settings)
        made.append((sched, engine))
        if start:
            sched.start()
        return sched, engine

    yield factory
    for sched, engine in made:
        engine.unblock()
        sched.close(timeout=WAIT)
        if sched._thread is not None:
            assert not sched._thread.is_alive(), "scheduler thread did not stop"


def submit(sched: Scheduler, prompt, max_tokens: int, *, qos: str = "agent", log=None, **kw):
    sink = Sink(log)
    req = Request(prompt_tokens=list(prompt), max_tokens=max_tokens, sink=sink, qos=qos,
                  sampling=SamplingParams(temperature=0.0), **kw)
    sched.submit(req)
    return req, sink


def seed_prefill_rate(sched: Scheduler, seconds_per_token: float) -> None:
    """Make the cost model have measured this prefill rate (as many earlier ticks would)."""
    for _ in range(120):
        sched.scheduler.costs.observe([StepTiming(prefill_tokens=512, decode_tokens=0,
                                        seconds=512 * seconds_per_token)])


def lane_plans(engine: FakeEngine, first_token: int):
    """(tick index, LanePlan) for the non-decode plans whose feed starts a prompt of ``first_token``s."""
    return [(i, lp) for i, plan in enumerate(engine.plans_snapshot()) for lp in plan.lanes
            if not lp.decode and lp.feed and lp.feed[0] == first_token]


# ---- completion ---------------------------------------------------------------------------------

def test_requests_complete_with_length(make):
    sched, engine = make(max_batch=4)
    jobs = [([1, 2, 3], 5), ([10, 11], 1), ([500], 7), ([998], 4)]
    sinks = [submit(sched, prompt, n)[1] for prompt, n in jobs]
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
    sched, _ = make()
    _, sink = submit(sched, [998], 4)
    sink.wait()
    assert sink.text == "<999><0><1><2>"


def test_eog_ends_with_stop_and_is_not_counted(make):
    sched, engine = make(FakeEngine(max_lanes=2, eog=9), max_batch=2)
    _, sink = submit(sched, [5], 10)
    fin = sink.wait()
    assert fin.finish_reason == "stop"
    assert fin.completion_tokens == 3          # <6><7><8>; the eog token 9 is not counted
    assert sink.text == "<6><7><8>"
    assert engine.errors == []


def test_eog_as_first_token(make):
    sched, _ = make(FakeEngine(max_lanes=2, eog=9), max_batch=2)
    _, sink = submit(sched, [8], 10)
    fin = sink.wait()
    assert fin.finish_reason == "stop"
    assert fin.completion_tokens == 0
    assert sink.text == ""


def test_ignore_eos_runs_to_length(make):
    sched, _ = make(FakeEngine(max_lanes=2, eog=9), max_batch=2)
    _, sink = submit(sched, [5], 6, ignore_eos=True)
    fin = sink.wait()
    assert fin.finish_reason == "length"
    assert fin.completion_tokens == 6
    assert sink.text == render(range(6, 12))


def test_stop_string_ends_with_stop(make):
    sched, _ = make()
    _, sink = submit(sched, [5], 10, stop=("<8>",))
    fin = sink.wait()
    assert fin.finish_reason == "stop"
    assert sink.text == "<6><7>"


def test_context_length_exceeded(make):
    sched, _ = make(FakeEngine(max_lanes=2, context_length=64), max_batch=2)
    for n in (64, 65, 200):
        with pytest.raises(ContextLengthExceeded) as exc:
            submit(sched, [1] * n, 4)
        assert exc.value.code == "context_length_exceeded"
        assert exc.value.status == 400
    assert sched.snapshot()["queued"] == 0
    with pytest.raises(SuperfluidError):
        submit(sched, [], 4)


def test_generation_stops_at_the_context_window(make):
    sched, engine = make(FakeEngine(max_lanes=2, context_length=64), max_batch=2)
    _, sink = submit(sched, [1] * 60, 100)
    fin = sink.wait()
    assert fin.finish_reason == "length"
    assert fin.completion_tokens == 4      # 60 + 4 = the 64-token window
    _, sink = submit(sched, [1] * 63, 100)
    fin = sink.wait()
    assert fin.finish_reason == "length"
    assert fin.completion_tokens == 1
    assert engine.errors == []


# ---- lanes ---------------------------------------------------------------------------------------

def test_never_more_than_max_batch_lanes(make):
    sched, engine = make(max_batch=3, start=False)
    jobs = [([i + 1] * (5 + 7 * i), 1 + i % 5) for i in range(10)]
    sinks = [submit(sched, prompt, n)[1] for prompt, n in jobs]
    sched.start()
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


def test_snapshot_slots_free_after_completion(make):
    sched, engine = make(max_batch=3)
    sinks = [submit(sched, [7, 8, 9], 3)[1] for _ in range(4)]
    for sink in sinks:
        sink.wait()
    snap = sched.snapshot()
    assert snap["model"] == "fake-test"
    assert [s["state"] for s in snap["slots"]] == ["free"] * 3
    assert [s["id"] for s in snap["slots"]] == [0, 1, 2]
    assert snap["queued"] == 0 and snap["queue"] == []
    assert snap["ticks"] >= 1
    assert not sched.busy()


def test_snapshot_shows_busy_slot_during_tick(make):
    sched, engine = make(max_batch=2)
    engine.block()
    req, sink = submit(sched, [1, 2, 3], 2, qos="background")
    assert engine.holding.wait(WAIT)
    snap = sched.snapshot()
    busy = [s for s in snap["slots"] if s["state"] != "free"]
    assert len(busy) == 1
    assert busy[0]["request_id"] == req.id
    assert busy[0]["state"] == "prefilling"
    assert busy[0]["qos"] == "background"
    assert busy[0]["prompt_tokens"] == 3
    engine.unblock()
    sink.wait()
    assert all(s["state"] == "free" for s in sched.snapshot()["slots"])


# ---- prefill budget and ordering ---------------------------------------------------------------

@pytest.mark.parametrize("rate, chunk", [
    (0.0008, 512),   # 0.5 s holds 625 tokens: whole 512-token chunks
    (0.001, 384),    # 0.5 s holds 500 tokens: too slow for one chunk, so 128-token steps
])
def test_long_prompt_split_while_a_lane_is_free(make, rate, chunk):
    engine = FakeEngine(max_lanes=8, prefill_s_per_token=rate)
    sched, engine = make(engine, max_batch=8, prefill_budget=4096, start=False)
    seed_prefill_rate(sched, rate)
    sched.start()
    _, sink = submit(sched, [3] * 3000, 2)
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
    assert sched.scheduler.costs.prefill_per_token() == pytest.approx(rate, rel=1e-3)
    assert engine.errors == []


def test_long_prompt_in_one_tick_when_every_lane_is_busy(make):
    rate = 0.0008
    sched, engine = make(FakeEngine(max_lanes=1, prefill_s_per_token=rate), max_batch=1,
                         prefill_budget=4096, start=False)
    seed_prefill_rate(sched, rate)
    sched.start()
    _, sink = submit(sched, [3] * 3000, 2)
    sink.wait()
    sizes = [len(lp.feed) for _, lp in lane_plans(engine, 3)]
    assert sizes == [3000]


def test_prefill_budget_caps_a_tick(make):
    sched, engine = make(max_batch=4, prefill_budget=256, start=False)
    seed_prefill_rate(sched, 1e-5)
    sched.start()
    _, sink = submit(sched, [4] * 1000, 1)
    sink.wait()
    sizes = [len(lp.feed) for _, lp in lane_plans(engine, 4)]
    assert sizes == [256, 256, 256, 232]


def test_shorter_remaining_prompt_prefilled_first(make):
    sched, engine = make(max_batch=4, prefill_budget=256, start=False)
    seed_prefill_rate(sched, 1e-5)
    _, long_sink = submit(sched, [1] * 600, 2)    # arrives first
    _, short_sink = submit(sched, [2] * 200, 2)
    sched.start()
    long_sink.wait()
    short_sink.wait()
    first = engine.plans_snapshot()[0]
    assert [lp.feed[0] for lp in first.lanes] == [2, 1]
    assert len(first.lanes[0].feed) == 200 and first.lanes[0].sample
    assert len(first.lanes[1].feed) == 56 and not first.lanes[1].sample
    assert first.prefill_tokens == 256
    assert engine.errors == []


def test_class_before_length_in_prefill_order(make):
    sched, engine = make(max_batch=4, prefill_budget=256, start=False)
    seed_prefill_rate(sched, 1e-5)
    _, a = submit(sched, [2] * 100, 2, qos="background")
    _, b = submit(sched, [1] * 600, 2, qos="agent")
    sched.start()
    a.wait()
    b.wait()
    first = engine.plans_snapshot()[0]
    assert [(lp.feed[0], len(lp.feed)) for lp in first.lanes] == [(1, 256)]


def test_finishing_urgent_prompt_prefills_nothing_lower_beside_it(make):
    sched, engine = make(max_batch=4, prefill_budget=4096, start=False)
    seed_prefill_rate(sched, 1e-5)
    _, agent = submit(sched, [2] * 200, 2, qos="agent")
    _, chat = submit(sched, [1] * 600, 2, qos="interactive")
    sched.start()
    agent.wait()
    chat.wait()
    first = engine.plans_snapshot()[0]
    assert [(lp.feed[0], len(lp.feed)) for lp in first.lanes] == [(1, 600)]
    agent_ticks = [i for i, _ in lane_plans(engine, 2)]
    assert agent_ticks and agent_ticks[0] >= 1


# ---- admission order ----------------------------------------------------------------------------

def test_admission_follows_class_priority_fifo_within_class(make):
    sched, engine = make(FakeEngine(max_lanes=1), max_batch=1, starvation_ticks=100000, start=False)
    log: list[tuple[str, str]] = []
    order = [("bg1", "background"), ("ag1", "agent"), ("bg2", "background"),
             ("in1", "interactive"), ("ag2", "agent"), ("in2", "interactive"),
             ("co1", "completion")]
    ids = {}
    sinks = []
    for name, cls in order:
        req, sink = submit(sched, [len(ids) + 1, 50], 2, qos=cls, log=log)
        ids[req.id] = name
        sinks.append(sink)
    sched.start()
    for sink in sinks:
        assert sink.wait().finish_reason == "length"
    admitted = [ids[rid] for kind, rid in log if kind == "admitted"]
    assert admitted == ["in1", "in2", "co1", "ag1", "ag2", "bg1", "bg2"]
    # One lane at a time: each finished before the next was admitted.
    seq = [(kind, ids[rid]) for kind, rid in log if kind in ("admitted", "finished")]
    assert seq == [(k, n) for n in admitted for k in ("admitted", "finished")]
    assert engine.errors == []


def test_urgent_arrival_asks_the_running_tick_to_stop(make):
    sched, engine = make(max_batch=2)
    engine.block()
    _, bg = submit(sched, [1, 2], 3, qos="background")
    assert engine.holding.wait(WAIT)
    before = engine.stop_requests
    _, ag = submit(sched, [3, 4], 3, qos="agent")
    assert engine.stop_requests == before          # an agent does not interrupt
    _, chat = submit(sched, [5, 6], 3, qos="interactive")
    assert engine.stop_requests == before + 1      # interactive work does
    engine.unblock()
    for sink in (bg, ag, chat):
        assert sink.wait().finish_reason == "length"
    assert bg.token_ids == expected_tokens(2, 3)   # an early-stopped tick repeats nothing
    assert engine.errors == []


# ---- cancel --------------------------------------------------------------------------------------

@pytest.mark.parametrize("watched", [False, True])
def test_a_quiet_tick_yields_to_any_newcomer(make, watched):
    """A reply sent whole with no stop strings runs in quiet ticks (longer than the free-lane
    target); a newcomer of any class ends one after the step in flight instead of waiting for it.
    A streamed reply keeps short ticks, and an agent arriving waits for the tick in flight."""
    sched, engine = make()
    engine.block(after=1)                              # the prefill tick runs, the next is held
    _, first = submit(sched, [1, 2], 500, streamed=watched)
    assert engine.holding.wait(WAIT)
    held = engine.plans_snapshot()[-1]
    assert held.quiet is not watched
    _, second = submit(sched, [3, 4], 3, qos="agent")
    assert engine.yield_requests == (0 if watched else 1)
    assert engine.stop_requests == 0                  # a yield lets the step in flight finish
    engine.unblock()
    assert second.wait().finish_reason == "length"
    assert first.wait().finish_reason == "length"
    assert not engine.errors


def test_cancel_queued_request(make):
    sched, engine = make(FakeEngine(max_lanes=1), max_batch=1)
    engine.block()
    running, run_sink = submit(sched, [1, 2], 3)
    assert engine.holding.wait(WAIT)
    queued, q_sink = submit(sched, [3, 4], 3)
    assert sched.snapshot()["queued"] == 1
    sched.cancel(queued.id)
    assert q_sink.done.is_set()                     # answered at once, not at the next tick
    fin = q_sink.events[-1]
    assert q_sink.kinds() == ["finished"]
    assert fin.finish_reason == "cancelled"
    assert fin.completion_tokens == 0
    assert sched.snapshot()["queued"] == 0
    engine.unblock()
    assert run_sink.wait().finish_reason == "length"
    sched.cancel("no-such-request")                 # unknown ids are ignored
    assert engine.errors == []


def test_cancel_running_request_frees_its_slot(make):
    sched, engine = make(FakeEngine(max_lanes=1), max_batch=1)
    engine.block()
    running, run_sink = submit(sched, [1, 2], 500)
    assert engine.holding.wait(WAIT)
    slot = engine.plans_snapshot()[-1].lanes[0].slot
    _, next_sink = submit(sched, [7], 3)
    n_plans = len(engine.plans_snapshot())
    stops = engine.stop_requests
    sched.cancel(running.id)
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
    assert all(s["state"] == "free" for s in sched.snapshot()["slots"])
    assert engine.errors == []


def test_cancel_running_request_alone_releases_slot(make):
    sched, engine = make(max_batch=2)
    engine.block()
    running, sink = submit(sched, [1, 2], 500)
    assert engine.holding.wait(WAIT)
    slot = engine.plans_snapshot()[-1].lanes[0].slot
    sched.cancel(running.id)
    assert sink.wait().finish_reason == "cancelled"
    assert wait_for(lambda: any(slot in p.release for p in engine.plans_snapshot()))
    release_plan = next(p for p in engine.plans_snapshot() if slot in p.release)
    assert release_plan.lanes == []
    assert all(s["state"] == "free" for s in sched.snapshot()["slots"])
    assert engine.errors == []


# ---- shutdown and robustness --------------------------------------------------------------------

def test_close_fails_queued_requests(make):
    sched, engine = make(FakeEngine(max_lanes=1), max_batch=1)
    engine.block()
    _, running = submit(sched, [1], 2)
    assert engine.holding.wait(WAIT)
    _, queued = submit(sched, [2], 2)
    closer = threading.Thread(target=sched.close, kwargs={"timeout": WAIT})
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
        submit(sched, [3], 2)


def test_class_lane_cap(make):
    sched, engine = make(max_batch=3, start=False, extra={"class-lanes": {"background": 1}})
    log: list[tuple[str, str]] = []
    bg_ids = {submit(sched, [10 + i], 2, qos="background", log=log)[0].id for i in range(3)}
    submit(sched, [20], 2, qos="agent", log=log)
    sched.start()
    assert wait_for(lambda: sum(1 for kind, _ in log if kind == "finished") == 4)
    first = engine.plans_snapshot()[0]
    assert sorted(lp.feed[0] for lp in first.lanes) == [10, 20]   # a free lane stays free
    running = peak = 0
    for kind, rid in log:
        if rid in bg_ids and kind in ("admitted", "finished"):
            running += 1 if kind == "admitted" else -1
            peak = max(peak, running)
    assert peak == 1


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_hook_failure_does_not_hang_the_model(make):
    sched, engine = make(max_batch=2, start=False)
    _, bad = submit(sched, [1], 2, qos="no-such-class")
    sched.start()
    assert bad.done.wait(1.0), "the request with a bad class was never answered"
    _, good = submit(sched, [2], 2)
    assert good.done.wait(1.0), "the model stopped serving"


def test_delta_token_ids_exclude_tokens_past_the_end(make):
    sched, _ = make(FakeEngine(max_lanes=2, eog=12), max_batch=2, start=False)
    sched.scheduler.costs.observe([StepTiming(prefill_tokens=0, decode_tokens=1, seconds=1e-4)])
    sched.start()  # decode is cheap, so one tick samples many tokens
    _, stop_sink = submit(sched, [5], 10, stop=("<8>",))
    _, eog_sink = submit(sched, [5], 10)
    assert stop_sink.wait().finish_reason == "stop"
    assert eog_sink.wait().finish_reason == "stop"
    assert eog_sink.text == "<6><7><8><9><10><11>"
    assert eog_sink.token_ids == [6, 7, 8, 9, 10, 11]     # actual: ... 11, 12 (the eog token)
    assert stop_sink.token_ids == [6, 7, 8]               # actual: 6 .. 12 (past the stop)


def test_delta_token_ids_include_tokens_without_released_text(make):
    sched, _ = make(max_batch=2, tick_decode_budget=1)   # one token per tick
    _, sink = submit(sched, [5], 10, stop=("<8>",))
    fin = sink.wait()
    assert fin.finish_reason == "stop" and sink.text == "<6><7>"
    assert len(sink.token_ids) == fin.completion_tokens  # actual: [6, 7] vs 3


def test_admitted_lane_prefill_not_starved_beyond_bound(make):
    sched, engine = make(max_batch=2, prefill_budget=256, starvation_ticks=3, start=False)
    seed_prefill_rate(sched, 1e-5)
    _, agent = submit(sched, [1] * 3000, 1, qos="agent")
    _, bg = submit(sched, [2] * 300, 1, qos="background")
    sched.start()
    agent.wait()
    bg.wait()
    bg_ticks = [i for i, _ in lane_plans(engine, 2)]
    assert bg_ticks[0] <= 3 + 1, f"background lane first prefilled at tick {bg_ticks[0]}"
