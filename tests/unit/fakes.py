"""Fakes for the unit tests of the loop, the scheduler and the KV manager, and the helpers that
drive them. No model, no worker, no server.

:class:`FakeEngine` is a fake of the Engine contract (``core/engine.py``, ``core/tick.py``), not a
model: per slot a token list as its KV, parked KV as token lists under their keys. It applies a
plan in the contract's order (``park``, ``drop_parked``, ``release``, then each lane: a reset lane's
KV comes from its seed and is cut to ``pos``), checks the plan against the contract (a slot once
per plan, in range, no release under a live lane, resets with sampling params, a seed that holds
``pos`` tokens, a lane that is not reset continuing exactly where its KV ends, non-empty feeds,
``max_new`` ≥ 1 when sampling, no seed or park the declared capabilities do not offer) and records
every violation in ``errors``, every plan in ``plans`` and every result in ``results``. It reports
fake step timings (a chosen prefill rate per token, a decode rate per round) for the cost model,
``kv_used``/``kv_capacity`` for the watermarks and parked bytes for the host tier.

Two samplers, chosen per engine:

* :func:`follow` (the default without a prefix cache): the token after the last one fed,
  ``(last + 1) % 1000``; token ``i`` renders as ``f"<{i}>"``, so outputs can be worked out by hand
  (:func:`expected_tokens`, :func:`render`), and an ``eog`` token ends a lane.
* :func:`kv_hash` (the default with a prefix cache): a hash of the slot's whole KV, so a lane
  seeded with the wrong KV samples other tokens than a cold run (:func:`expected`).

For threaded tests a tick can be held mid-flight (:meth:`FakeEngine.block`); ``request_stop`` and
``request_yield`` end a held tick, as a real engine's next step would. :class:`FakePoolEngine`
adds a shared KV pool that refuses a plan whose tokens do not fit.

The drivers go through the loop's public API only: :func:`submit`, :func:`step` and
:func:`drive` (``ModelLoop.step()``), :func:`run_stepped`, :func:`run_threaded`."""

from __future__ import annotations

import copy
import threading
import time

from superfluid.core.engine import Engine, EngineCapabilities, ModelInfo
from superfluid.core.hookspecs import hookimpl
from superfluid.core.lane import LaneEvent
from superfluid.core.loop import ModelLoop
from superfluid.core.request import Request, SamplingParams
from superfluid.core.tick import LaneResult, StepTiming, TickPlan, TickResult

WAIT = 5.0  # seconds: the most any single wait in these tests may take


# ---- samplers and their expected outputs ---------------------------------------------------------

def follow(kv: list[int]) -> int:
    """The token after the last one in the KV."""
    return (kv[-1] + 1) % 1000


def kv_hash(kv: list[int]) -> int:
    """A hash of everything in the slot's KV."""
    h = 7
    for t in kv:
        h = (h * 131 + t + 1) % 1_000_003
    return h % 1000


def expected_tokens(last_prompt_token: int, n: int) -> list[int]:
    """What :func:`follow` samples after a prompt ending in ``last_prompt_token``."""
    return [(last_prompt_token + i) % 1000 for i in range(1, n + 1)]


def expected(prompt: list[int], n: int) -> list[int]:
    """The cold (unseeded) output of ``n`` tokens of :func:`kv_hash` for ``prompt``."""
    kv, out = list(prompt), []
    for _ in range(n):
        token = kv_hash(kv)
        out.append(token)
        kv.append(token)
    return out


def render(tokens) -> str:
    return "".join(f"<{t}>" for t in tokens)


def prompt(start: int, n: int) -> list[int]:
    return [(start + i) % 1000 for i in range(n)]


# ---- the fake engine ------------------------------------------------------------------------------

class FakeEngine(Engine):
    """A fake engine (see the module docstring). ``prefix_cache`` declares that a slot's KV can
    be kept, cut and copied (and, unless ``supports_parking`` says otherwise, parked in host
    memory); it also picks the :func:`kv_hash` sampler unless ``sampler`` is given."""

    BYTES_PER_TOKEN = 4000

    def __init__(self, *, max_lanes: int = 8, context_length: int = 4096, eog: int | None = None,
                 prefix_cache: bool = False, supports_parking: bool | None = None, sampler=None,
                 kv_capacity: int | None = None, prefill_s_per_token: float = 1e-5,
                 decode_s_per_round: float = 1e-4, spare_slots: int = 0, shared_pool: bool = False):
        parking = prefix_cache if supports_parking is None else supports_parking
        self.capabilities = EngineCapabilities(max_lanes=max_lanes, context_length=context_length,
                                               prefix_cache=prefix_cache, supports_parking=parking,
                                               spare_slots=spare_slots, shared_pool=shared_pool)
        self.info = ModelInfo(name="fake", path="", n_vocab=1000, n_ctx_train=context_length)
        self.eog = eog
        self.sampler = sampler or (kv_hash if prefix_cache else follow)
        self.kv_capacity = kv_capacity or (max_lanes + spare_slots) * context_length
        self.prefill_rate = prefill_s_per_token
        self.decode_rate = decode_s_per_round
        self.plans: list[TickPlan] = []
        self.results: list[TickResult] = []
        self.errors: list[str] = []             # plan-contract violations seen
        self.kv: dict[int, list[int]] = {}      # slot -> tokens in its KV
        self.parked: dict[str, list[int]] = {}  # park key -> tokens of the KV parked under it
        self.hold = threading.Event()           # cleared: ticks with lanes wait (see block())
        self.hold.set()
        self.hold_from = 0                      # the first tick a block() holds
        self.holding = threading.Event()        # set while a tick is held
        self.stop_requests = 0
        self.yield_requests = 0
        self.started = False
        self.closed = False
        self._stop = threading.Event()
        self._lock = threading.Lock()

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
        result = self.execute(plan)
        with self._lock:
            self.results.append(result)
        return result

    # -- the tick --
    def execute(self, plan: TickPlan, feed: bool = True) -> TickResult:
        """Apply ``plan``; with ``feed`` false only its parks, drops, releases and seeds (what an
        engine does before its first step), reporting nothing fed."""
        result = TickResult()
        self._prelude(plan, result)
        live = self._seed_lanes(plan, result, feed)
        if not feed:
            for lp in live:
                result.lanes[lp.slot] = LaneResult(slot=lp.slot)
            return self._finish(result)
        if live and not self.hold.is_set() and len(self.plans) > self.hold_from:
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
                for lp in live:
                    result.lanes[lp.slot] = LaneResult(slot=lp.slot)
                return self._finish(result)
        self._feed(live, result)
        return self._finish(result)

    def _prelude(self, plan: TickPlan, result: TickResult) -> None:
        """park, (load, save: not offered), drop_parked, release: in the contract's order."""
        for slot, key in plan.park:
            if not self.capabilities.supports_parking:
                self.errors.append(f"park {key!r}: the engine does not support parking")
            held = self.kv.get(slot)
            if not held:
                self.errors.append(f"park {key!r}: slot {slot} holds no KV")
                result.parked[key] = 0
                continue
            self.parked[key] = list(held)
            result.parked[key] = len(held) * self.BYTES_PER_TOKEN
        if plan.load or plan.save:
            self.errors.append(f"load {plan.load} / save {plan.save}: the engine does not persist KV")
        for key in plan.drop_parked:
            self.parked.pop(key, None)
        for slot in plan.release:
            self.kv.pop(slot, None)

    def _seed_lanes(self, plan: TickPlan, result: TickResult, feed: bool) -> list:
        """Check each lane plan and set up its slot's KV; the lane plans that run."""
        caps = self.capabilities
        slots = [lp.slot for lp in plan.lanes]
        if len(slots) != len(set(slots)):
            self.errors.append(f"a slot twice in one plan: {slots}")
        if len(slots) > caps.max_lanes:
            self.errors.append(f"{len(slots)} lanes > {caps.max_lanes}")
        if set(plan.release) & {lp.slot for lp in plan.lanes if not lp.reset}:
            self.errors.append(f"released a live lane's slot: release {plan.release}, lanes {slots}")
        live = []
        for lp in plan.lanes:
            if not 0 <= lp.slot < caps.max_lanes + caps.spare_slots:
                self.errors.append(f"slot {lp.slot} out of range")
            if lp.reset:
                if lp.sampling is None:
                    self.errors.append(f"slot {lp.slot}: reset without sampling params")
                if not caps.prefix_cache and (lp.seed.slot is not None or lp.seed.shared or
                                              (lp.seed.own and lp.pos)):
                    self.errors.append(f"slot {lp.slot}: seed {lp.seed} at pos {lp.pos} without a prefix cache")
                if not caps.supports_parking and lp.seed.key is not None:
                    self.errors.append(f"slot {lp.slot}: parked seed {lp.seed} without parking")
                if lp.seed.key is not None:
                    held = self.parked.get(lp.seed.key) if lp.seed.shared else self.parked.pop(lp.seed.key, None)
                    base = list(held) if held is not None else None
                elif lp.seed.slot is not None:
                    base = list(self.kv.get(lp.seed.slot, []))
                else:
                    base = list(self.kv.get(lp.slot, []))
                if base is None or len(base) < lp.pos:
                    self.errors.append(f"slot {lp.slot}: seed holds {None if base is None else len(base)} "
                                       f"tokens, pos {lp.pos} (seed {lp.seed})")
                    self.kv.pop(lp.slot, None)
                    result.lanes[lp.slot] = LaneResult(slot=lp.slot, restore_failed=True)
                    continue
                self.kv[lp.slot] = base[:lp.pos]
            else:
                if lp.slot not in self.kv:
                    self.errors.append(f"slot {lp.slot}: used without a reset")
                    self.kv[lp.slot] = []
                if lp.pos != len(self.kv[lp.slot]):
                    self.errors.append(f"slot {lp.slot}: pos {lp.pos} but KV holds {len(self.kv[lp.slot])}")
                del self.kv[lp.slot][lp.pos:]
            if feed and not lp.feed:
                self.errors.append(f"slot {lp.slot}: empty feed")
            if feed and lp.sample and lp.max_new < 1:
                self.errors.append(f"slot {lp.slot}: sample with max_new {lp.max_new}")
            live.append(lp)
        return live

    def _feed(self, live: list, result: TickResult) -> None:
        prefill = sum(len(lp.feed) for lp in live if not lp.decode)
        n_decode = sum(1 for lp in live if lp.decode)
        first = prefill * self.prefill_rate + (self.decode_rate if n_decode else 0.0)
        rounds_active: list[int] = []  # lanes still sampling in decode round r (r >= 1)
        for lp in live:
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
                    token = self.sampler(kv)
                    res.tokens.append(token)
                    if token == self.eog and not lp.ignore_eos:
                        res.eog = True
                        break
            result.lanes[lp.slot] = res
        if live:
            result.steps.append(StepTiming(prefill_tokens=prefill, decode_tokens=n_decode, seconds=first))
        for n in rounds_active:
            result.steps.append(StepTiming(prefill_tokens=0, decode_tokens=n, seconds=self.decode_rate))

    def _finish(self, result: TickResult) -> TickResult:
        result.seconds = sum(s.seconds for s in result.steps)
        result.parked_bytes = sum(len(v) for v in self.parked.values()) * self.BYTES_PER_TOKEN
        result.kv_used = sum(len(v) for v in self.kv.values())
        result.kv_capacity = self.kv_capacity
        return result


class FakePoolEngine(FakeEngine):
    """A FakeEngine (with a prefix cache) whose KV lives in one pool of ``pool`` cells shared by
    every lane: a plan whose tokens do not fit is refused whole (``TickResult.rejected_tokens``).
    A refused plan still has its parks, releases and seeds applied, as the llama.cpp runner does
    before its first step, and feeds nothing; the plan recorded is the one that was refused."""

    def __init__(self, *, pool: int, **kw):
        kw.setdefault("prefix_cache", True)
        super().__init__(kv_capacity=pool, **kw)
        self.pool = pool
        self.refused = 0
        self.live_peak = 0

    def execute(self, plan: TickPlan, feed: bool = True) -> TickResult:
        held = {s: len(v) for s, v in self.kv.items() if s not in plan.release}
        for lp in plan.lanes:
            held[lp.slot] = lp.pos
        need = sum(len(lp.feed) + (lp.max_new - 1 if lp.sample else 0) for lp in plan.lanes)
        self.live_peak = max(self.live_peak, len(plan.lanes))
        if not plan.lanes or sum(held.values()) + need <= self.pool:
            return super().execute(plan, feed)
        self.refused += 1
        result = super().execute(plan, feed=False)
        result.lanes = {lp.slot: LaneResult(slot=lp.slot) for lp in plan.lanes}
        result.rejected_tokens = need
        result.stopped_early = True
        return result


# ---- pressure sources and observers ---------------------------------------------------------------

class LevelSource:
    """A pressure source the test sets."""

    name = "test"

    def __init__(self, value: str = "ok"):
        self.value = value
        self.calls = 0

    def level(self) -> str:
        self.calls += 1
        return self.value


class RaisingSource:
    """A pressure source whose sensor fails at every reading."""

    name = "broken"

    def level(self) -> str:
        raise RuntimeError("sensor unavailable")


class StatsObserver:
    """Collects TickStats per model through ``superfluid_tick_done``."""

    def __init__(self):
        self._lock = threading.Lock()
        self._stats: list[tuple[str, object]] = []

    @hookimpl
    def superfluid_tick_done(self, model, stats):
        with self._lock:
            self._stats.append((model, stats))

    def of(self, model: str) -> list:
        with self._lock:
            return [s for m, s in self._stats if m == model]


class Clock:
    """A module clock (``monotonic``) that moves only when the test advances it."""

    def __init__(self):
        self.t = time.monotonic()

    def monotonic(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += seconds


# ---- requests -------------------------------------------------------------------------------------

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
        assert self.done.wait(WAIT), f"no finished event; got {self.kinds()}"
        return self.events[-1]

    @property
    def text(self) -> str:
        return "".join(e.text for e in self.events if e.kind == "delta")

    @property
    def token_ids(self) -> list[int]:
        return [t for e in self.events if e.kind == "delta" for t in e.token_ids]

    def kinds(self) -> list[str]:
        return [e.kind for e in self.events]


def submit(loop: ModelLoop, tokens, max_tokens: int, *, qos: str = "agent", log=None, **kw):
    """Queue a greedy request; (Request, Sink)."""
    sink = Sink(log)
    req = Request(prompt_tokens=list(tokens), max_tokens=max_tokens, sink=sink, qos=qos,
                  sampling=SamplingParams(temperature=0.0), **kw)
    loop.submit(req)
    return req, sink


def wait_for(predicate, timeout: float = WAIT) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.002)
    return predicate()


# ---- driving a loop that is not started -----------------------------------------------------------

def step(loop: ModelLoop, engine: FakeEngine):
    """One ``loop.step()``: (the plan the engine ran, its TickStats), or (None, None)."""
    n = len(engine.plans)
    stats = loop.step()
    if stats is None:
        return None, None
    return engine.plans[n], stats


def drive(loop: ModelLoop, engine: FakeEngine, until, max_ticks: int = 300) -> list:
    """Step until ``until()``; the TickStats of every tick run."""
    out = []
    for _ in range(max_ticks):
        if until():
            return out
        _, stats = step(loop, engine)
        if stats is not None:
            out.append(stats)
        elif not loop.busy():
            break
    assert until(), "the scheduler stopped making progress"
    return out


def first_lane_plan(plans: list[TickPlan], start: int = 0):
    """(index, LanePlan) of the first lane plan at or after ``plans[start]``."""
    for i in range(start, len(plans)):
        if plans[i].lanes:
            return i, plans[i].lanes[0]
    raise AssertionError("no lane plan")


def run_stepped(loop: ModelLoop, engine: FakeEngine, tokens, max_tokens, **kw):
    """Submit and step until it finishes with the cold output; (sink, its first LanePlan, stats)."""
    n0 = len(engine.plans)
    _, sink = submit(loop, tokens, max_tokens, **kw)
    stats = drive(loop, engine, sink.done.is_set)
    assert sink.events[-1].kind == "finished"
    assert sink.token_ids == expected(tokens, max_tokens)
    return sink, first_lane_plan(engine.plans, n0)[1], stats


def run_threaded(loop: ModelLoop, engine: FakeEngine, tokens, max_tokens, **kw):
    """On a started loop: submit, wait for the cold output; (sink, its first LanePlan).
    Requests run one at a time."""
    n0 = len(engine.plans_snapshot())
    _, sink = submit(loop, tokens, max_tokens, **kw)
    assert sink.wait().kind == "finished"
    assert sink.token_ids == expected(tokens, max_tokens)
    return sink, first_lane_plan(engine.plans_snapshot(), n0)[1]


# ---- looking at a loop ----------------------------------------------------------------------------

def cached_by_slot(loop: ModelLoop) -> dict[int, int]:
    """Cached tokens per free slot, as /slots shows them."""
    return {s["id"]: s["cached_tokens"] for s in loop.snapshot()["slots"] if s["state"] == "free"}


def seed_prefill_rate(loop: ModelLoop, seconds_per_token: float) -> None:
    """Make the cost model have measured this prefill rate (as many earlier ticks would)."""
    for _ in range(120):
        loop.scheduler.costs.observe([StepTiming(prefill_tokens=512, decode_tokens=0,
                                                 seconds=512 * seconds_per_token)])


def lane_plans(engine: FakeEngine, first_token: int):
    """(tick index, LanePlan) for the non-decode plans whose feed starts a prompt of ``first_token``s."""
    return [(i, lp) for i, plan in enumerate(engine.plans_snapshot()) for lp in plan.lanes
            if not lp.decode and lp.feed and lp.feed[0] == first_token]


def format_registry():
    """The chat formats the built-in plugin registers (what a daemon's ``formats`` holds)."""
    from superfluid.plugins.formats import builtin_registry

    return builtin_registry()
