"""Memory pressure and the prefix cache (spec: scheduling-and-qos.md, "Memory pressure").

Unit tests for PSI parsing and levels (plugins/pressure), the pressure-source hook swapped in by a
TOML ``plugins`` list, the prefix machinery (core/prefix.py), and the real Scheduler with the real
default policies driving ``FakePrefixEngine``: a fake engine that keeps per-slot KV as token
lists, honours ``LanePlan.pos/seed`` and ``TickPlan.park/drop_parked/
release``, and reports ``kv_used``/``kv_capacity`` so the watermarks can trigger.

The fake's sampled token depends on the *whole* KV of its slot (a hash of it), so a lane seeded
with the wrong KV produces different output than a cold run; every test compares against
``expected()``, the cold output.

Most scheduler tests run the scheduler's own thread; the pressure tests step it by hand
(plan -> engine tick -> commit, exactly what ``Scheduler._run`` does) with a fake clock for the
scheduler module, so which tick sees the pressure is deterministic. No servers, no models."""

from __future__ import annotations

import copy
import pathlib
import sys
import threading
import time
import uuid
from types import SimpleNamespace

import pytest

import superfluid.core.prefix as prefix_mod
import superfluid.core.kv as kv_mod
import superfluid.core.pressure as pressure_mod
import superfluid.core.scheduler as scheduler_mod
from superfluid.core.cli import load
from superfluid.core.engine import Engine, EngineCapabilities, ModelInfo
from superfluid.core.errors import ConfigError
from superfluid.core.hookspecs import hookimpl
from superfluid.core.lane import LaneEvent
from superfluid.core.plugins import make_plugin_manager
from superfluid.core.prefix import MIN_HOST_TOKENS, MIN_REUSE, HostTier, SlotCache, common_prefix
from superfluid.core.request import Request, SamplingParams
from superfluid.core.loop import ModelLoop as Scheduler
from superfluid.core.settings import SchedulerSettings
from superfluid.core.tick import LaneResult, StepTiming, TickPlan, TickResult
from superfluid.plugins.pressure import sources as psrc
from superfluid.plugins.pressure.sources import OsPressure, level_from, macos_level, parse_psi

WAIT = 5.0  # seconds: the most any single wait may take
PSI_DIR = pathlib.Path(__file__).parent / "data" / "psi"


# ---- the fake engine ----------------------------------------------------------------------------

def next_token(kv: list[int]) -> int:
    """The fake's sampler: a hash of everything in the slot's KV."""
    h = 7
    for t in kv:
        h = (h * 131 + t + 1) % 1_000_003
    return h % 1000


def expected(prompt: list[int], n: int) -> list[int]:
    """The cold (unseeded) output of ``n`` tokens for ``prompt``."""
    kv, out = list(prompt), []
    for _ in range(n):
        token = next_token(kv)
        out.append(token)
        kv.append(token)
    return out


class FakePrefixEngine(Engine):
    """A fake engine with a prefix cache and host-memory parking (like the llama.cpp runner):
    per slot a token list as its KV; ``park`` copies a slot's KV under a key, ``drop_parked``
    forgets keys, ``release`` clears slots, then each reset lane's KV is restored (``restore``,
    kept parked with ``keep_parked``), copied (``copy_from``) or its own, cut to ``pos``. A seed
    that cannot hold ``pos`` tokens is reported as ``restore_failed`` and recorded in ``errors``
    (the scheduler never plans one in these tests). Every plan is recorded."""

    BYTES_PER_TOKEN = 4000

    def __init__(self, *, max_lanes: int = 4, context_length: int = 4096, kv_capacity: int | None = None):
        self.capabilities = EngineCapabilities(max_lanes=max_lanes, context_length=context_length,
                                               prefix_cache=True, supports_parking=True)
        self.info = ModelInfo(name="fake-prefix", path="", n_vocab=1000, n_ctx_train=context_length)
        self.kv_capacity = kv_capacity or max_lanes * context_length
        self.kv: dict[int, list[int]] = {}
        self.parked: dict[str, list[int]] = {}
        self.plans: list[TickPlan] = []
        self.errors: list[str] = []
        self._lock = threading.Lock()

    def plans_snapshot(self) -> list[TickPlan]:
        with self._lock:
            return list(self.plans)

    # -- Engine --
    def start(self, progress=None) -> None:
        pass

    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = True) -> list[int]:
        return [ord(c) % 1000 for c in text]

    def token_bytes(self, token: int) -> bytes:
        return f"<{token}>".encode()

    def request_stop(self) -> None:
        pass

    def clear_stop(self) -> None:
        pass

    def close(self) -> None:
        pass

    def run_tick(self, plan: TickPlan) -> TickResult:
        with self._lock:
            self.plans.append(copy.deepcopy(plan))
        result = TickResult()
        for slot, key in plan.park:
            held = self.kv.get(slot)
            if not held:
                self.errors.append(f"park {key!r}: slot {slot} holds no KV")
                result.parked[key] = 0
                continue
            self.parked[key] = list(held)
            result.parked[key] = len(held) * self.BYTES_PER_TOKEN
        for key in plan.drop_parked:
            self.parked.pop(key, None)
        for slot in plan.release:
            self.kv.pop(slot, None)
        slots = [lp.slot for lp in plan.lanes]
        if len(slots) != len(set(slots)):
            self.errors.append(f"a slot twice in one plan: {slots}")
        if set(plan.release) & {lp.slot for lp in plan.lanes if not lp.reset}:
            self.errors.append(f"released a live lane's slot: release {plan.release}, lanes {slots}")
        live = []
        for lp in plan.lanes:
            if not 0 <= lp.slot < self.capabilities.max_lanes:
                self.errors.append(f"slot {lp.slot} out of range")
            if lp.reset:
                if lp.sampling is None:
                    self.errors.append(f"slot {lp.slot}: reset without sampling params")
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
                if len(self.kv[lp.slot]) < lp.pos:
                    self.errors.append(f"slot {lp.slot}: pos {lp.pos} but KV holds {len(self.kv[lp.slot])}")
                del self.kv[lp.slot][lp.pos:]
            if not lp.feed:
                self.errors.append(f"slot {lp.slot}: empty feed")
            if lp.sample and lp.max_new < 1:
                self.errors.append(f"slot {lp.slot}: sample with max_new {lp.max_new}")
            live.append(lp)

        prefill = sum(len(lp.feed) for lp in live if not lp.decode)
        n_decode = sum(1 for lp in live if lp.decode)
        for lp in live:
            kv = self.kv[lp.slot]
            kv.extend(lp.feed)
            res = LaneResult(slot=lp.slot, n_fed=len(lp.feed), n_prefill=0 if lp.decode else len(lp.feed))
            if lp.sample:
                for r in range(lp.max_new):
                    if r > 0:
                        kv.append(res.tokens[-1])
                        res.n_fed += 1
                    res.tokens.append(next_token(kv))
            result.lanes[lp.slot] = res
        if live:
            result.steps.append(StepTiming(prefill_tokens=prefill, decode_tokens=n_decode,
                                           seconds=prefill * 1e-5 + (1e-4 if n_decode else 0.0)))
        result.seconds = sum(s.seconds for s in result.steps)
        result.parked_bytes = sum(len(v) for v in self.parked.values()) * self.BYTES_PER_TOKEN
        result.kv_used = sum(len(v) for v in self.kv.values())
        result.kv_capacity = self.kv_capacity
        return result


# ---- helpers ----------------------------------------------------------------------------------

class Sink:
    def __init__(self):
        self.events: list[LaneEvent] = []
        self.done = threading.Event()

    def __call__(self, event: LaneEvent) -> None:
        self.events.append(event)
        if event.kind in ("finished", "error"):
            self.done.set()

    def wait(self) -> LaneEvent:
        assert self.done.wait(WAIT), f"no finished event; got {self.kinds()}"
        return self.events[-1]

    def kinds(self) -> list[str]:
        return [e.kind for e in self.events]

    @property
    def token_ids(self) -> list[int]:
        return [t for e in self.events if e.kind == "delta" for t in e.token_ids]


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
    def __init__(self):
        self.t = time.monotonic()

    def monotonic(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += seconds


def prompt(start: int, n: int) -> list[int]:
    return [(start + i) % 1000 for i in range(n)]


def wait_for(predicate, timeout: float = WAIT) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.002)
    return predicate()


def submit(sched: Scheduler, tokens, max_tokens: int, *, qos: str = "agent"):
    sink = Sink()
    req = Request(prompt_tokens=list(tokens), max_tokens=max_tokens, sink=sink, qos=qos,
                  sampling=SamplingParams(temperature=0.0))
    sched.submit(req)
    return req, sink


def first_lane_plan(plans: list[TickPlan], start: int = 0):
    """(index, LanePlan) of the first lane plan at or after ``plans[start]``."""
    for i in range(start, len(plans)):
        if plans[i].lanes:
            return i, plans[i].lanes[0]
    raise AssertionError("no lane plan")


def run_threaded(sched, engine, tokens, max_tokens, **kw):
    """Submit, wait for the finish; (sink, first LanePlan of this request). Requests run one at a time."""
    n0 = len(engine.plans_snapshot())
    _, sink = submit(sched, tokens, max_tokens, **kw)
    assert sink.wait().kind == "finished"
    assert sink.token_ids == expected(tokens, max_tokens)
    return sink, first_lane_plan(engine.plans_snapshot(), n0)[1]


def cached_by_slot(sched) -> dict[int, int]:
    return {s["id"]: s["cached_tokens"] for s in sched.snapshot()["slots"] if s["state"] == "free"}


# ---- stepping the scheduler by hand (what Scheduler._run does, one iteration per call) ---------

def step(sched: Scheduler, engine: FakePrefixEngine):
    n = len(engine.plans)
    stats = sched.step()
    if stats is None:
        return None, None
    return engine.plans[n], stats


def drive(sched, engine, until, max_ticks: int = 300) -> list:
    """Step until ``until()``; the TickStats of every tick run."""
    out = []
    for _ in range(max_ticks):
        if until():
            return out
        plan, stats = step(sched, engine)
        if stats is not None:
            out.append(stats)
        elif not sched.busy():
            break
    assert until(), "the scheduler stopped making progress"
    return out


def run_stepped(sched, engine, tokens, max_tokens, **kw):
    n0 = len(engine.plans)
    _, sink = submit(sched, tokens, max_tokens, **kw)
    stats = drive(sched, engine, sink.done.is_set)
    assert sink.events[-1].kind == "finished"
    assert sink.token_ids == expected(tokens, max_tokens)
    return sink, first_lane_plan(engine.plans, n0)[1], stats


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


# ---- fixtures ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def plugin_manager():
    manager = make_plugin_manager()
    assert manager.has_plugin("qos")
    observer = StatsObserver()
    manager.register(observer, "test-pressure-cache-observer")
    return manager, observer


@pytest.fixture
def observer(plugin_manager):
    return plugin_manager[1]


@pytest.fixture
def make(plugin_manager):
    """make(engine=None, *, sources=None, start=True, extra={}, **settings) -> (scheduler, engine).
    Every scheduler is closed afterwards."""
    pm = plugin_manager[0]
    made: list[Scheduler] = []

    def factory(engine=None, *, sources=None, start=True, extra=None, **overrides):
        max_batch = overrides.pop("max_batch", 4)
        engine = engine or FakePrefixEngine(max_lanes=max_batch)
        extra = _typed(extra, overrides)
        settings = SchedulerSettings(max_batch=max_batch, context_length=engine.capabilities.context_length,
                                     extra=extra, **overrides)
        sched = Scheduler(f"pc-{uuid.uuid4().hex[:8]}", engine, pm.hook, settings, pressure_sources=sources)
        made.append(sched)
        if start:
            sched.start()
        return sched, engine

    yield factory
    for sched in made:
        sched.close(timeout=WAIT)
        if sched._thread is not None:
            assert not sched._thread.is_alive(), "scheduler thread did not stop"


@pytest.fixture
def stepped(make, monkeypatch):
    """stepped(**settings) -> (scheduler (not started), engine, LevelSource, Clock): pressure is read
    at every commit, and the scheduler module's clock only moves when the test advances it."""
    clock = Clock()
    monkeypatch.setattr(pressure_mod, "PRESSURE_CHECK_S", 0.0)
    for mod in (kv_mod, scheduler_mod):
      monkeypatch.setattr(mod, "time", SimpleNamespace(monotonic=clock.monotonic, time=time.time,
                                                               sleep=time.sleep, perf_counter=time.perf_counter))

    def factory(*, kv_capacity=None, level="ok", **kw):
        max_batch = kw.get("max_batch", 4)
        source = LevelSource(level)
        engine = FakePrefixEngine(max_lanes=max_batch, kv_capacity=kv_capacity)
        sched, engine = make(engine, sources=[source], start=False, **kw)
        return sched, engine, source, clock

    return factory


# =================================================================================================
# 1. PSI parsing and levels
# =================================================================================================

def test_parse_psi_samples():
    calm = parse_psi((PSI_DIR / "calm").read_text())
    assert calm == {"some": {"avg10": 0.0, "avg60": 0.0, "avg300": 0.0, "total": 0.0},
                    "full": {"avg10": 0.0, "avg60": 0.0, "avg300": 0.0, "total": 0.0}}
    some = parse_psi((PSI_DIR / "some-pressure").read_text())
    assert some["some"] == {"avg10": 23.51, "avg60": 12.07, "avg300": 3.85, "total": 48213377.0}
    assert some["full"]["avg10"] == 2.14
    full = parse_psi((PSI_DIR / "full-pressure").read_text())
    assert full["some"]["avg10"] == 78.91
    assert full["full"] == {"avg10": 41.37, "avg60": 30.02, "avg300": 11.58, "total": 456789012.0}


def test_parse_psi_tolerates_odd_input():
    assert parse_psi("") == {}
    # No "full" line (as for CPU PSI on older kernels), indentation, junk lines, a bad value.
    text = "  some avg10=12.50 avg60=bad avg300=1.00 total=5\nnoise here\ncpu avg10=99\n"
    assert parse_psi(text) == {"some": {"avg10": 12.5, "avg300": 1.0, "total": 5.0}}
    assert level_from(parse_psi(text), None) == "warning"


@pytest.mark.parametrize("some,full,available,level", [
    (0.0, 0.0, None, "ok"),
    (9.99, 0.0, None, "ok"),
    (10.0, 0.0, None, "warning"),            # some avg10 >= 10 %
    (60.0, 9.99, None, "warning"),
    (60.0, 10.0, None, "critical"),          # full avg10 >= 10 %
    (0.0, 10.0, None, "critical"),
    (None, None, 0.50, "ok"),
    (None, None, 0.10, "ok"),                # under 10 % available: warning
    (None, None, 0.0999, "warning"),
    (None, None, 0.05, "warning"),           # under 5 % available: critical
    (None, None, 0.0499, "critical"),
    (None, None, 0.0, "critical"),
    (None, None, None, "ok"),
    (10.0, 0.0, 0.50, "warning"),
    (0.0, 0.0, 0.07, "warning"),
    (0.0, 0.0, 0.01, "critical"),
    (12.0, 0.0, 0.04, "critical"),           # the worse of the two
    (80.0, 20.0, 0.90, "critical"),
])
def test_level_from_thresholds(some, full, available, level):
    psi = None if some is None else {"some": {"avg10": some}, "full": {"avg10": full}}
    assert level_from(psi, available) == level


def test_level_from_samples():
    psi = {name: parse_psi((PSI_DIR / name).read_text()) for name in ("calm", "some-pressure", "full-pressure")}
    assert level_from(psi["calm"], 0.5) == "ok"
    assert level_from(psi["some-pressure"], 0.5) == "warning"
    assert level_from(psi["full-pressure"], 0.5) == "critical"
    assert level_from(psi["calm"], 0.08) == "warning"
    assert level_from(psi["calm"], 0.03) == "critical"
    assert level_from({}, 0.5) == "ok"


@pytest.mark.parametrize("value,level", [(1, "ok"), (2, "warning"), (4, "critical"), (0, "ok")])
def test_macos_level(value, level):
    assert macos_level(value) == level


linux_only = pytest.mark.skipif(sys.platform == "darwin", reason="OsPressure reads sysctl on macOS")


@linux_only
def test_os_pressure_reads_psi_file_with_real_psutil():
    for name in ("calm", "some-pressure", "full-pressure"):
        assert OsPressure(psi_path=str(PSI_DIR / name)).level() in psrc.LEVELS
    assert OsPressure(psi_path=str(PSI_DIR / "full-pressure")).level() == "critical"
    assert OsPressure(psi_path=str(PSI_DIR / "no-such-file")).level() in psrc.LEVELS  # no PSI: memory only
    assert OsPressure.name == "os"


@linux_only
def test_os_pressure_levels_with_fixed_available_memory(monkeypatch, tmp_path):
    memory = {"available": 50, "total": 100}
    monkeypatch.setattr(psrc.psutil, "virtual_memory", lambda: SimpleNamespace(**memory))
    path = tmp_path / "memory"
    source = OsPressure(psi_path=str(path))
    assert source.level() == "ok"                          # no PSI file: available memory only
    for name, level in (("calm", "ok"), ("some-pressure", "warning"), ("full-pressure", "critical"),
                        ("calm", "ok")):                   # read again at every call
        path.write_text((PSI_DIR / name).read_text())
        assert source.level() == level, name
    memory.update(available=8)
    assert source.level() == "warning"
    memory.update(available=4)
    assert source.level() == "critical"
    memory.update(available=0, total=0)                    # no total: PSI only
    assert source.level() == "ok"


# =================================================================================================
# 2. The pressure-source plugin, swapped in by TOML
# =================================================================================================

PLUGIN_SOURCE = '''
from superfluid.core.hookspecs import hookimpl


class FixedSource:
    name = "fixed"

    def __init__(self, level):
        self._level = level

    def level(self):
        return self._level


@hookimpl
def superfluid_add_pressure_sources(register, config):
    register(FixedSource("critical"))
'''


@pytest.fixture
def pressure_plugin(tmp_path, monkeypatch):
    """(module name, TOML path): a module defining a pressure source, named by a TOML plugins list."""
    name = f"sf_test_pressure_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(PLUGIN_SOURCE)
    monkeypatch.syspath_prepend(str(tmp_path))
    toml = tmp_path / "superfluid.toml"
    toml.write_text(f'plugins = ["{name}"]\n')
    yield name, toml
    sys.modules.pop(name, None)


def all_sources(pm, config) -> list:
    sources = []
    pm.hook.superfluid_add_pressure_sources(register=sources.append, config=config)
    return sources


def test_toml_plugin_source_replaces_os_pressure(pressure_plugin):
    name, toml = pressure_plugin
    config, pm = load(["serve", "--config", str(toml), "--no-os-pressure"])
    assert config["os-pressure"] is False
    assert name in config.plugins and pm.has_plugin(name)
    sources = all_sources(pm, config)
    assert len(sources) == 1
    assert type(sources[0]).__module__ == name and sources[0].level() == "critical"


def test_toml_plugin_source_beside_os_pressure(pressure_plugin):
    name, toml = pressure_plugin
    config, pm = load(["serve", "--config", str(toml)])
    assert config["os-pressure"] is True
    sources = all_sources(pm, config)
    assert len(sources) == 2
    assert sorted(type(s).__name__ for s in sources) == ["FixedSource", "OsPressure"]
    assert [s.level() for s in sources if type(s).__module__ == name] == ["critical"]


def test_os_pressure_key_in_toml_and_flag_precedence(pressure_plugin):
    name, toml = pressure_plugin
    toml.write_text(f'plugins = ["{name}"]\nos-pressure = false\n')
    config, pm = load(["serve", "--config", str(toml)])
    assert [type(s).__name__ for s in all_sources(pm, config)] == ["FixedSource"]
    config, pm = load(["serve", "--config", str(toml), "--os-pressure"])  # the flag wins
    assert sorted(type(s).__name__ for s in all_sources(pm, config)) == ["FixedSource", "OsPressure"]


def test_plugin_source_drives_a_scheduler(pressure_plugin, make):
    """As the daemon wires it: the plugin's sources go to the scheduler, whose ticks report them."""
    name, toml = pressure_plugin
    config, pm = load(["serve", "--config", str(toml), "--no-os-pressure"])
    sched, engine = make(sources=all_sources(pm, config), start=False)
    submit(sched, prompt(100, 20), 2)
    _, stats = step(sched, engine)
    assert stats.pressure == "critical"


# =================================================================================================
# 3. The prefix machinery
# =================================================================================================

@pytest.mark.parametrize("a,b,n", [
    ([], [], 0),
    ([], [1, 2], 0),
    ([1, 2], [], 0),
    ([1], [1], 1),
    ([1], [2], 0),
    ([1, 2, 3], [1, 2, 3], 3),
    ([1, 2, 3], [1, 2, 3, 4, 5], 3),          # a prefix of the other
    ([1, 2, 3, 4, 5], [1, 2, 3], 3),
    ([1, 2, 3], [9, 2, 3], 0),                # differ at the first
    ([1, 2, 3], [1, 2, 9], 2),                # differ at the last
    ([1, 2, 3, 4], [1, 2, 3, 5, 6, 7], 3),
])
def test_common_prefix_edges(a, b, n):
    assert common_prefix(a, b) == n
    assert common_prefix(b, a) == n


def test_common_prefix_matches_brute_force():
    import random
    rng = random.Random(1234)
    for _ in range(400):
        n = rng.randrange(0, 120)
        a = [rng.randrange(3) for _ in range(n)]
        cut = rng.randrange(0, n + 1)
        b = a[:cut] + [rng.randrange(3) for _ in range(rng.randrange(0, 40))]
        brute = 0
        while brute < min(len(a), len(b)) and a[brute] == b[brute]:
            brute += 1
        assert common_prefix(a, b) == brute, (a, b)


@pytest.fixture
def prefix_clock(monkeypatch):
    """The prefix module's clock, moved by the test (LRU order)."""
    clock = Clock()
    monkeypatch.setattr(prefix_mod, "time", SimpleNamespace(monotonic=clock.monotonic))
    return clock


def test_slot_cache_store_forget_tokens():
    cache = SlotCache()
    cache.store(1, [1, 2, 3])
    cache.store(2, [4, 5])
    assert cache.tokens(1) == [1, 2, 3] and cache.tokens(3) == []
    assert cache.cached_tokens() == 5
    cache.store(1, [])                 # storing nothing forgets
    assert cache.tokens(1) == [] and cache.cached_tokens() == 2
    cache.forget(2)
    cache.forget(7)                    # unknown: no error
    assert cache.cached_tokens() == 0 and cache.lru_slots() == []


def test_slot_cache_lru_order(prefix_clock):
    cache = SlotCache()
    for slot in (2, 0, 3):
        cache.store(slot, prompt(slot * 100, 20))
        prefix_clock.advance(1)
    assert cache.lru_slots() == [2, 0, 3]
    cache.store(2, prompt(200, 30))    # used again: most recent
    prefix_clock.advance(1)
    assert cache.lru_slots() == [0, 3, 2]
    cache.forget(3)
    assert cache.lru_slots() == [0, 2]


def test_best_slot_longest_prefix_wins(prefix_clock):
    cache = SlotCache()
    p = prompt(100, 60)
    cache.store(0, p[:20] + [999] * 10)    # shares 20
    cache.store(1, p[:40] + [998])         # shares 40
    cache.store(2, p[:30])                 # shares 30
    assert cache.best_slot(p, [0, 1, 2, 3]) == (1, 40)
    assert cache.best_slot(p, [0, 2, 3]) == (2, 30)     # only free slots count
    assert cache.best_slot(p, [0, 3]) == (0, 20)


def test_best_slot_minimum_reuse(prefix_clock):
    cache = SlotCache()
    p = prompt(100, 200)
    cache.store(0, p[:MIN_REUSE - 1] + [999])
    slot, reuse = cache.best_slot(p, [0, 1, 2])
    assert reuse == 0 and slot in (1, 2)                 # 15 of 200: an empty slot instead
    cache.store(1, p[:MIN_REUSE])
    assert cache.best_slot(p, [0, 1, 2]) == (1, MIN_REUSE)


def test_best_slot_keeps_a_similar_head_in_place(prefix_clock):
    """Below MIN_REUSE nothing is copied, but a cache whose head is a tenth of the prompt or more
    (llama-server's slot similarity) is taken over an empty slot: the scheduler cuts it after
    the head, for free. A pinned cache is never taken for its head."""
    cache = SlotCache()
    p = prompt(100, 40)
    cache.store(0, p[:3] + [999] * 20)                   # 3 of 40: under a tenth
    cache.store(1, p[:7] + [999] * 20)                   # 7 of 40
    cache.store(2, p[:5] + [999] * 20)
    assert cache.best_slot(p, [0, 1, 2, 3]) == (1, 0)
    assert cache.best_slot(p, [0, 3]) == (3, 0)           # a head too short: the empty slot
    cache.pin(p[:7] + [999] * 20)
    assert cache.best_slot(p, [1, 2, 3])[0] == 2
    assert cache.best_slot(p, [1, 2, 3], busy=[6])[0] == 3  # the narrowest span still comes first


def test_best_slot_leaves_a_token_to_feed(prefix_clock):
    cache = SlotCache()
    p = prompt(100, 40)
    cache.store(0, list(p))                              # the whole prompt cached
    assert cache.best_slot(p, [0, 1]) == (0, 39)
    assert cache.best_slot(p[:25], [0, 1]) == (0, 24)   # a prompt shorter than the cache
    short = p[:MIN_REUSE]                                # all MIN_REUSE tokens cached, one must be fed
    assert cache.best_slot(short, [0, 1]) == (0, 0)     # 15 reusable: no copy, the head kept in place
    assert cache.best_slot(p[:MIN_REUSE + 1], [0, 1]) == (0, MIN_REUSE)
    assert cache.best_slot(p[:1], [0]) == (0, 0)


def test_best_slot_fallback_empty_then_lru(prefix_clock):
    cache = SlotCache()
    for slot in (0, 1, 2):
        cache.store(slot, prompt(slot * 100, 30))
        prefix_clock.advance(1)
    other = prompt(700, 30)
    assert cache.best_slot(other, [0, 1, 2, 3]) == (3, 0)  # an empty slot first
    assert cache.best_slot(other, [2, 0, 1]) == (0, 0)     # else the least recently used
    cache.store(0, prompt(0, 30))
    prefix_clock.advance(1)
    assert cache.best_slot(other, [2, 0, 1]) == (1, 0)
    assert cache.best_slot([], [2, 0, 1]) == (1, 0)        # a parked lane: no reuse at all


def test_host_tier_add_thresholds():
    assert HostTier(0).add(prompt(0, 500)) is None                    # no host memory
    host = HostTier(1 << 20)
    assert host.add(prompt(0, MIN_HOST_TOKENS - 1)) is None            # too short to keep
    k1 = host.add(prompt(0, MIN_HOST_TOKENS))
    k2 = host.add(prompt(100, 80))
    assert k1 and k2 and k1 != k2 and len(host) == 2
    assert host.bytes == 0                                             # sizes come from the engine


def test_host_tier_parked_sizes():
    host = HostTier(1 << 20)
    k1, k2 = host.add(prompt(0, 70)), host.add(prompt(100, 70))
    host.parked(k1, 1000)
    host.parked(k2, 500)
    assert host.bytes == 1500
    host.parked("prefix-unknown", 99)                                  # ignored
    assert host.bytes == 1500 and len(host) == 2
    host.parked(k2, 0)                                                 # the engine could not park it
    assert len(host) == 1 and host.bytes == 1000
    assert host.best(prompt(100, 70)) == (None, 0)


def test_host_tier_bytes_follow_every_change():
    host = HostTier(1 << 20)
    k1, k2, k3 = (host.add(prompt(i * 100, 70)) for i in range(3))
    host.parked(k1, 1000)
    host.parked(k2, 500)
    host.parked(k1, 600)                                               # reported again: replaced, not added
    assert host.bytes == 1100
    host.remove(k2)
    host.remove(k2)                                                    # gone already: nothing changes
    assert host.bytes == 600 and len(host) == 2
    host.parked(k3, 50)
    host.remove(k1)
    assert host.bytes == 50


def test_host_tier_best():
    host = HostTier(1 << 20)
    p = prompt(100, 120)
    k_short = host.add(p[:70] + [999] * 10)
    k_long = host.add(p[:100])
    host.add(prompt(500, 90))
    assert host.best(p) == (k_long, 100)
    assert host.best(p[:100]) == (k_long, 99)        # one token is always left to feed
    assert host.best(p[:80] + [5] * 30) == (k_long, 80)
    assert host.best(p[:75] + [5] * 30) == (k_long, 75)
    assert host.best(p[:70] + [999] * 10 + [5]) == (k_short, 80)
    assert host.best(prompt(800, 90)) == (None, 0)
    assert HostTier(1 << 20).best(p) == (None, 0)


def test_host_tier_trim_lru_until_under_limit(prefix_clock):
    host = HostTier(1000)
    keys = []
    for i in range(3):
        keys.append(host.add(prompt(i * 100, 70)))
        host.parked(keys[-1], 400)
        prefix_clock.advance(1)
    assert host.trim() == [keys[0]]                   # 1200 > 1000: the oldest goes
    assert host.bytes == 800 and host.trim() == []    # under the limit: nothing
    k3 = host.add(prompt(500, 70))
    host.parked(k3, 400)
    prefix_clock.advance(1)
    key, _ = host.best(prompt(100, 90))
    assert key == keys[1]
    host.touch(key)                                   # imported: keys[1] becomes recent
    prefix_clock.advance(1)
    assert host.trim() == [keys[2]]
    big = HostTier(1000)
    kb = big.add(prompt(0, 70))
    big.parked(kb, 5000)                              # larger than the whole tier
    assert big.trim() == [kb] and len(big) == 0


def test_host_tier_clear():
    host = HostTier(1 << 20)
    keys = [host.add(prompt(i * 100, 70)) for i in range(3)]
    host.parked(keys[0], 10)
    assert host.clear() == keys
    assert len(host) == 0 and host.bytes == 0 and host.clear() == []


def test_host_lru_not_refreshed_by_a_lookup_that_imports_nothing(stepped):
    """One slot, 1 MiB of host memory (two 400 kB prefixes). S is a 20-token system prompt.
    P1 = S+x is evicted to host (h1) by P2, P2 (unrelated) by P3 = S+y (h2; P3 imports h1's S:
    a real use). P3's next turn is seeded from the slot (100 tokens) and imports nothing, yet the
    lookup refreshes h1. P4 evicts P3's turn (h3): over the limit, the least recently used entry
    is h1 (last used when P3 started, before h2 was evicted), so P2 must still come back."""
    sched, engine, _, _ = stepped(max_batch=1, extra={"host-cache-mb": 1})
    S = prompt(900, 20)
    p1, p2, p3 = S + prompt(100, 80), prompt(300, 100), S + prompt(500, 80)
    p3_next = p3 + prompt(600, 20)
    run_stepped(sched, engine, p1, 1)
    run_stepped(sched, engine, p2, 1)                     # p1 -> h1 ("prefix-1")
    _, lp, _ = run_stepped(sched, engine, p3, 1)          # p2 -> h2; p3 imports S from h1
    assert lp.seed.key == "prefix-1" and lp.pos == 20
    _, lp, _ = run_stepped(sched, engine, p3_next, 1)     # seeded from the slot, not from h1
    assert lp.seed.key is None and lp.pos == 100
    run_stepped(sched, engine, prompt(700, 100), 1)       # p3_next -> h3; the tier trims one entry
    assert len(sched.scheduler.kv.host) == 2
    _, lp, _ = run_stepped(sched, engine, p2, 1)
    assert lp.seed.key == "prefix-2" and lp.pos == 99


# =================================================================================================
# 4. The scheduler with a prefix-caching fake engine
# =================================================================================================

def test_finished_lane_leaves_its_slot_cached_and_a_repeat_is_seeded(make, observer):
    sched, engine = make(max_batch=2)
    p = prompt(100, 40)
    _, lp1 = run_threaded(sched, engine, p, 3)
    assert lp1.reset and lp1.pos == 0 and lp1.feed == p
    cached = cached_by_slot(sched)
    assert cached == {lp1.slot: 40 + 3 - 1, 1 - lp1.slot: 0}  # prompt + all but the last sampled token
    assert wait_for(lambda: any(s.cached_tokens == 42 for s in observer.of(sched.name)))

    _, lp2 = run_threaded(sched, engine, p, 3)
    assert lp2.reset and lp2.slot == lp1.slot
    assert lp2.pos == len(p) - 1 and lp2.feed == p[-1:]
    assert lp2.seed.own
    assert wait_for(lambda: sum(s.cache_hits for s in observer.of(sched.name)) == 1)
    assert sum(s.cache_hit_tokens for s in observer.of(sched.name)) == len(p) - 1
    assert engine.errors == []


def test_next_turn_is_seeded_with_the_whole_cached_conversation(make):
    sched, engine = make(max_batch=2)
    p = prompt(100, 50)
    s1, _ = run_threaded(sched, engine, p, 4)
    turn2 = p + s1.token_ids + prompt(400, 20)
    _, lp = run_threaded(sched, engine, turn2, 3)
    assert lp.reset and lp.pos == 50 + 4 - 1
    assert lp.feed == turn2[lp.pos:]
    assert engine.errors == []


def test_a_short_prompt_sent_again_keeps_its_head_in_place(make, observer):
    """Too short to be worth a copy (MIN_REUSE), but most of the prompt: the lane takes that
    slot over the empty one and keeps the cached tokens in place; no copy, no restore."""
    sched, engine = make(max_batch=2)
    p = prompt(100, MIN_REUSE)          # every reusable token count is below MIN_REUSE
    _, first = run_threaded(sched, engine, p, 2)
    _, lp = run_threaded(sched, engine, p, 2)
    assert lp.slot == first.slot and lp.reset
    assert lp.pos == MIN_REUSE - 1 and lp.feed == p[-1:]
    assert lp.seed.slot is None and lp.seed.key is None
    assert sum(s.cache_hits for s in observer.of(sched.name)) == 1


def test_a_short_head_is_kept_in_place_when_the_slot_cache_is_overwritten(make, observer):
    """No empty slot left and nothing worth a copy: the lane takes the least recently used cache,
    which first goes to host memory whole, and keeps the few tokens it shares with the prompt
    (llama-server does the same); no copy, no restore."""
    sched, engine = make(max_batch=2, extra={"host-cache-mb": 1})
    a, b = prompt(100, 80), prompt(300, 80)
    _, lp_a = run_threaded(sched, engine, a, 3)
    run_threaded(sched, engine, b, 3)                   # the other slot: both now hold a cache
    c = a[:5] + prompt(600, 70)                         # shares 5 tokens with a: below MIN_REUSE
    n0 = len(engine.plans_snapshot())
    _, lp = run_threaded(sched, engine, c, 3)
    assert lp.slot == lp_a.slot and lp.reset
    assert lp.pos == 5 and lp.feed == c[5:]
    assert lp.seed.slot is None and lp.seed.key is None
    parked = [slot for plan in engine.plans_snapshot()[n0:] for slot, _ in plan.park]
    assert parked == [lp_a.slot]                        # a's whole cache went to host memory first
    assert engine.errors == []

    d = prompt(900, 40)                                 # shares nothing with the LRU cache (b)
    _, lp = run_threaded(sched, engine, d, 3)
    assert lp.pos == 0 and lp.feed == d


def test_burst_sharing_a_prefix_copies_it_from_the_running_lane(make):
    sched, engine = make(max_batch=4)
    shared = prompt(100, 64)
    a, b = shared + prompt(600, 10), shared + prompt(700, 12)
    _, sa = submit(sched, a, 5)
    _, sb = submit(sched, b, 5)
    sa.wait(), sb.wait()
    assert sa.token_ids == expected(a, 5) and sb.token_ids == expected(b, 5)
    plans = engine.plans_snapshot()
    fed = sum(len(lp.feed) for plan in plans for lp in plan.lanes if not lp.decode)
    assert fed == len(a) + len(b) - 64           # the shared 64 tokens were prefilled once
    first_b = [lp for plan in plans for lp in plan.lanes if lp.reset and lp.feed[-1] == b[-1]][0]
    assert first_b.pos == 64
    first_a = [lp for plan in plans for lp in plan.lanes if lp.reset and lp.feed[-1] == a[-1]][0]
    assert first_b.seed.slot == first_a.slot or first_b.slot == first_a.slot
    assert engine.errors == []


def test_evicted_prefix_comes_back_from_host_memory(make):
    sched, engine = make(max_batch=1, extra={"host-cache-mb": 1})
    p1, p2 = prompt(100, 100), prompt(300, 100)
    run_threaded(sched, engine, p1, 2)
    run_threaded(sched, engine, p2, 2)
    parks = [pk for plan in engine.plans_snapshot() for pk in plan.park]
    assert parks == [(0, "prefix-1")]                   # p1's slot went to host memory for p2
    _, lp = run_threaded(sched, engine, p1, 2)
    assert lp.reset and lp.seed.key == "prefix-1" and lp.seed.shared and lp.pos == 99
    assert "prefix-1" in engine.parked                  # kept parked for other lanes
    assert [pk for plan in engine.plans_snapshot() for pk in plan.park][-1] == (0, "prefix-2")
    assert len(sched.scheduler.kv.host) == 2 and engine.errors == []


def test_watermarks_evict_lru_prefixes_down_to_low_with_hysteresis(make, observer):
    """Capacity 400 cells, high 85 % (340), low 70 % (280)."""
    engine = FakePrefixEngine(max_lanes=4, kv_capacity=400)
    sched, engine = make(engine, extra={"pressure-high": 0.85, "pressure-low": 0.70})
    A, B, C = prompt(100, 90), prompt(300, 90), prompt(500, 90)
    slot = {}
    for name, p in (("A", A), ("B", B), ("C", C)):
        slot[name] = run_threaded(sched, engine, p, 1)[1].slot
    _, lp = run_threaded(sched, engine, A, 1)            # A used again: LRU order is now B, C, A
    assert lp.slot == slot["A"] and lp.pos == 89
    assert not any(plan.release for plan in engine.plans_snapshot())   # 270 / 400 < 85 %

    n0 = len(engine.plans_snapshot())
    _, lp = run_threaded(sched, engine, prompt(700, 110), 4)  # 380 / 400 >= 85 %: evict to <= 70 %
    slot["D"] = lp.slot
    releases = [plan.release for plan in engine.plans_snapshot()[n0:] if plan.release]
    assert releases == [[slot["B"], slot["C"]]]          # LRU first, and only down to 200 / 400
    assert cached_by_slot(sched) == {slot["A"]: 90, slot["B"]: 0, slot["C"]: 0, slot["D"]: 113}
    evicting = [s.evictions for s in observer.of(sched.name) if s.evictions]
    assert evicting == [{"watermark": 2}]

    n0 = len(engine.plans_snapshot())
    slot["E"] = run_threaded(sched, engine, prompt(850, 80), 1)[1].slot   # 283 / 400: above low, below high
    assert not any(plan.release for plan in engine.plans_snapshot()[n0:])
    slot["F"] = run_threaded(sched, engine, prompt(50, 60), 1)[1].slot    # 343 / 400: evict A only
    assert wait_for(lambda: any(plan.release for plan in engine.plans_snapshot()[n0:]))
    releases = [plan.release for plan in engine.plans_snapshot()[n0:] if plan.release]
    assert releases == [[slot["A"]]]
    assert cached_by_slot(sched) == {slot["A"]: 0, slot["D"]: 113, slot["E"]: 80, slot["F"]: 60}
    assert [s.evictions for s in observer.of(sched.name) if s.evictions] == [{"watermark": 2}, {"watermark": 1}]
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
    engine = FakePrefixEngine(max_lanes=4, kv_capacity=200)
    sched, engine = make(engine, extra={"pressure-high": 0.5, "pressure-low": 0.2},
                         tick_decode_budget=2)
    reqs = [submit(sched, prompt(100 * k, 60), n) for k, n in ((1, 4), (2, 8), (3, 12))]
    for p, (_, s) in zip((1, 2, 3), reqs):
        s.wait()
        assert s.token_ids == expected(prompt(100 * p, 60), len(s.token_ids))
    plans = engine.plans_snapshot()
    assert len({lp.slot for plan in plans for lp in plan.lanes}) == 3
    assert_no_live_slot_released(plans)
    stats = observer.of(sched.name)
    assert all(s.kv_used / s.kv_capacity >= 0.5 for s in stats if s.lanes_busy == 3)
    assert sum(s.evictions.get("watermark", 0) for s in stats) <= 2     # only finished lanes' prefixes
    assert engine.errors == []


def fill(sched, engine, prompts, max_tokens=1):
    return [run_stepped(sched, engine, p, max_tokens)[1].slot for p in prompts]


def test_warning_evicts_every_prefix_and_drops_host_memory(stepped):
    sched, engine, source, clock = stepped(max_batch=4, extra={"host-cache-mb": 1})
    P = [prompt(100 * k, 80) for k in range(10)]
    slots = fill(sched, engine, P[1:5])                  # four slots cached
    _, lp, _ = run_stepped(sched, engine, P[5], 1)       # evicts P1 (LRU) to host memory
    assert lp.slot == slots[0] and len(sched.scheduler.kv.host) == 1
    assert [pk for plan in engine.plans for pk in plan.park] == [(slots[0], "prefix-1")]
    assert "prefix-1" in engine.parked

    source.value = "warning"
    _, sink6 = submit(sched, P[6], 3)
    plan, stats = step(sched, engine)                    # P6 evicts P2 to host, then the warning is read
    assert plan.park == [(slots[1], "prefix-2")]
    assert stats.pressure == "warning"
    assert stats.host_entries == 0 and stats.host_bytes == 0 and stats.cached_tokens == 0
    assert "os_pressure" in stats.evictions
    source.value = "ok"
    plan, stats = step(sched, engine)
    assert plan.drop_parked == ["prefix-1", "prefix-2"]
    assert plan.release == [slots[2], slots[3], slots[0]]   # P3, P4, P5: every cached prefix, LRU order
    assert plan.park == []
    assert engine.parked == {}
    assert sched.scheduler.pressure == "ok"
    drive(sched, engine, sink6.done.is_set)
    assert sink6.token_ids == expected(P[6], 3) and "paused" not in sink6.kinds()

    # For a while nothing moves to host memory: slot reuse evicts without parking.
    n0 = len(engine.plans)
    fill(sched, engine, P[7:10] + [P[1], P[2]])
    assert not any(plan.park for plan in engine.plans[n0:])
    assert not any(lp.seed.key for plan in engine.plans[n0:] for lp in plan.lanes)   # host entries gone
    # After the pause (30 s on the scheduler's clock) the host tier is open again.
    clock.advance(kv_mod.HOST_PAUSE_S + 1)
    n0 = len(engine.plans)
    run_stepped(sched, engine, P[3], 1)
    assert [pk for plan in engine.plans[n0:] for pk in plan.park] == [(engine.plans[n0].lanes[0].slot, "prefix-3")]
    assert engine.errors == []


def test_warning_and_pause_also_stop_watermark_parking(stepped):
    """Capacity 400, high 85 %, low 70 %, 1 MiB of host memory: after a warning, watermark
    evictions release prefixes without moving them to host memory."""
    sched, engine, source, clock = stepped(max_batch=4, kv_capacity=400, extra={"host-cache-mb": 1})
    fill(sched, engine, [prompt(100, 70)])
    source.value = "warning"
    _, _, stats = run_stepped(sched, engine, prompt(300, 70), 1)   # a warning round empties the cache
    assert stats[-1].pressure == "warning" and stats[-1].cached_tokens == 0
    source.value = "ok"
    n0 = len(engine.plans)
    c, d, e = fill(sched, engine, [prompt(500, 100), prompt(700, 100), prompt(900, 100)])   # 300 / 400
    _, lp, stats = run_stepped(sched, engine, prompt(50, 100), 1)   # 400 / 400: evict C, D
    assert stats[-1].evictions == {"watermark": 2} and stats[-1].kv_used == 400
    plan, _ = step(sched, engine)
    assert plan.release == [c, d] and plan.park == []               # host memory still closed
    assert not any(plan.park for plan in engine.plans[n0:])
    assert len(sched.scheduler.kv.host) == 0 and engine.parked == {}
    assert engine.errors == []


def test_critical_preempts_decoding_background_lanes_only(stepped):
    sched, engine, source, clock = stepped(max_batch=4, extra={"host-cache-mb": 1, "park": True},
                                           tick_decode_budget=3, prefill_budget=64)
    bg_p, ag_p, bgp_p = prompt(100, 40), prompt(300, 40), prompt(500, 700)
    bg, bg_sink = submit(sched, bg_p, 12, qos="background")
    ag, ag_sink = submit(sched, ag_p, 12, qos="agent")
    bgp, bgp_sink = submit(sched, bgp_p, 3, qos="background")

    def state(req):
        for s in sched.snapshot()["slots"]:
            if s.get("request_id") == req.id:
                return s["state"]
        return None

    drive(sched, engine, lambda: state(bg) == "decoding" and state(ag) == "decoding")
    assert state(bgp) == "prefilling"

    source.value = "warning"                              # a warning preempts nothing
    _, stats = step(sched, engine)
    assert stats.pressure == "warning" and stats.preempted == 0
    assert state(bg) == "decoding" and state(ag) == "decoding" and state(bgp) == "prefilling"

    source.value = "critical"
    bg_slot = next(s["id"] for s in sched.snapshot()["slots"] if s.get("request_id") == bg.id)
    _, stats = step(sched, engine)
    assert stats.pressure == "critical" and stats.preempted == 1
    assert "paused" in bg_sink.kinds()
    assert "paused" not in ag_sink.kinds() and "paused" not in bgp_sink.kinds()
    assert state(ag) == "decoding" and state(bgp) == "prefilling"
    source.value = "ok"
    plan, _ = step(sched, engine)
    assert bg_slot in plan.release
    assert plan.park == []                                # --park, but host memory is closed
    drive(sched, engine, lambda: bg_sink.done.is_set() and ag_sink.done.is_set() and bgp_sink.done.is_set())
    assert bg_sink.token_ids == expected(bg_p, 12)
    assert ag_sink.token_ids == expected(ag_p, 12)
    assert bgp_sink.token_ids == expected(bgp_p, 3)
    assert not any(plan.park for plan in engine.plans)
    assert not any(lp.seed.key for plan in engine.plans for lp in plan.lanes)
    assert engine.errors == []


def test_no_parking_in_the_tick_that_sees_os_pressure(stepped):
    sched, engine, source, clock = stepped(max_batch=4, kv_capacity=400,
                                           extra={"host-cache-mb": 1, "pressure-high": 0.85, "pressure-low": 0.70})
    fill(sched, engine, [prompt(100, 90), prompt(300, 90), prompt(500, 90)])   # 270 / 400
    source.value = "warning"
    submit(sched, prompt(700, 110), 3)
    _, stats = step(sched, engine)       # 380 / 400: the watermark and the warning in one commit
    assert stats.pressure == "warning"
    plan, _ = step(sched, engine)
    assert plan.park == []


def test_a_failing_pressure_source_does_not_stop_the_model(make, monkeypatch):
    died = []
    monkeypatch.setattr(threading, "excepthook", died.append)   # the scheduler thread's uncaught exception
    sched, engine = make(sources=[RaisingSource()])
    _, sink = submit(sched, prompt(100, 20), 2)
    wait_for(lambda: sink.done.is_set() or not sched._thread.is_alive())
    assert sched._thread.is_alive(), f"scheduler thread died: {[repr(a.exc_value) for a in died]}"
    assert sink.done.is_set() and sink.events[-1].kind == "finished"


# =================================================================================================
# Pinned prefixes
# =================================================================================================

def test_slot_cache_pinned_prefixes_are_evicted_last(prefix_clock):
    system = prompt(1000, 30)
    cache = SlotCache(pinned=[system])
    cache.store(0, system + prompt(100, 20))      # pinned, oldest
    prefix_clock.advance(1)
    cache.store(1, prompt(200, 40))               # unpinned
    prefix_clock.advance(1)
    cache.store(2, system + prompt(300, 20))      # pinned
    prefix_clock.advance(1)
    cache.store(3, prompt(400, 40))               # unpinned, newest
    assert [cache.pinned(s) for s in range(4)] == [True, False, True, False]
    assert cache.lru_slots() == [1, 3, 0, 2]      # unpinned LRU first, then pinned oldest first
    # an unrelated prompt overwrites an unpinned cache, not the older pinned one
    assert cache.best_slot(prompt(900, 40), [0, 1, 2, 3]) == (1, 0)
    assert cache.best_slot(prompt(900, 40), [0, 2]) == (0, 0)   # only pinned left: oldest yields


def test_pin_prompt_option_from_flags_and_toml(tmp_path):
    from superfluid.core.cli import load
    config, _ = load(["serve", "--pin-prompt", "A", "--pin-prompt", "B"])
    assert config.models[0]["pin-prompt"] == ["A", "B"]
    toml = tmp_path / "c.toml"
    toml.write_text('pin-prompt = ["<|im_start|>system\\nBe brief.<|im_end|>\\n"]\n')
    config, _ = load(["serve", "--config", str(toml)])
    assert config.models[0]["pin-prompt"] == ["<|im_start|>system\nBe brief.<|im_end|>\n"]
    toml.write_text('pin-prompt = [""]\n')
    with pytest.raises(ConfigError, match="pin-prompt"):
        load(["serve", "--config", str(toml)])


def test_watermarks_evict_pinned_prefixes_last(make):
    """Capacity 400, high 85 %, low 70 %: an unpinned newer cache goes before the older pinned one."""
    system = prompt(1000, 40)
    engine = FakePrefixEngine(max_lanes=4, kv_capacity=400)
    sched, engine = make(engine, extra={"pressure-high": 0.85, "pressure-low": 0.70,
                                        "pinned-tokens": [system]})
    pinned_slot = run_threaded(sched, engine, system + prompt(100, 50), 1)[1].slot   # oldest, pinned
    other_slot = run_threaded(sched, engine, prompt(300, 90), 1)[1].slot            # newer, unpinned
    third_slot = run_threaded(sched, engine, prompt(500, 90), 1)[1].slot            # newest, unpinned
    n0 = len(engine.plans_snapshot())
    run_threaded(sched, engine, prompt(700, 110), 4)                               # over 85 %
    assert wait_for(lambda: any(plan.release for plan in engine.plans_snapshot()[n0:]))
    releases = [plan.release for plan in engine.plans_snapshot()[n0:] if plan.release]
    assert releases and pinned_slot not in releases[0]
    assert releases[0][0] == other_slot and third_slot in releases[0]
    assert cached_by_slot(sched)[pinned_slot] == 90
    assert engine.errors == []


def test_a_branching_lane_copies_the_cache_and_keeps_it_whole(stepped):
    """A lane that shares only part of a free slot's cache copies that part into an empty slot,
    so the cache (another conversation) stays whole; a lane that would need the slot being
    copied from waits one tick instead of overwriting it (or failing)."""
    sched, engine, _, _ = stepped(max_batch=2)
    conversation = prompt(100, 60)
    run_stepped(sched, engine, conversation, 3)             # cached in one slot: 62 tokens
    (cached_slot,) = [s for s, n in cached_by_slot(sched).items() if n]
    branch = conversation[:30] + prompt(500, 20)
    n0 = len(engine.plans)
    _, a = submit(sched, branch, 2)
    _, b = submit(sched, prompt(700, 40), 2)
    step(sched, engine)
    first = engine.plans[n0]
    (lp,) = first.lanes                                      # b waits: its only slot is a copy source
    assert lp.seed.slot == cached_slot and lp.slot != cached_slot and lp.pos == 30
    drive(sched, engine, lambda: a.done.is_set() and b.done.is_set())
    assert a.token_ids == expected(branch, 2) and b.token_ids == expected(prompt(700, 40), 2)
    assert engine.errors == []


def test_best_slot_keeps_busy_slots_together(prefix_clock):
    """With ``busy`` given (an engine with compact_slots: llama.cpp attends over every KV buffer
    between the lowest and highest slot in a step) the slot next to the busy ones wins over an
    older cache or an empty slot further away; a reusable prefix still wins over both."""
    cache = SlotCache()
    for slot in (6, 7, 2):
        cache.store(slot, prompt(slot * 100, 20))
        prefix_clock.advance(1)
    free = [1, 2, 5, 6, 7]                                   # 0, 3, 4 are busy
    assert cache.best_slot(prompt(900, 30), free) == (5, 0)          # no busy info: an empty slot
    assert cache.best_slot(prompt(900, 30), free, [0, 3, 4]) == (1, 0)  # inside 0..4, empty first
    assert cache.best_slot(prompt(900, 30), [5, 6, 7], [3, 4]) == (5, 0)
    assert cache.best_slot(prompt(900, 30), [6, 7], [0]) == (6, 0)   # the nearer cache, though newer
    assert cache.best_slot(prompt(700, 30), [6, 7], [0]) == (7, 20)  # reuse beats span
