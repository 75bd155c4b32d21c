"""Fixtures for the unit tests of the loop, the scheduler and the KV manager: the real plugin
manager (the default qos policies, loaded through the entry points), loops on fake engines
(``make``, ``stepped``) and the fake clocks of the modules that read one."""

from __future__ import annotations

import time
import uuid
from types import SimpleNamespace

import pytest

import superfluid.core.kv_room as kv_room_mod
import superfluid.core.prefix as prefix_mod
import superfluid.core.pressure as pressure_mod
import superfluid.core.scheduler as scheduler_mod
from superfluid.core import lane_guard
from superfluid.core.loop import ModelLoop
from superfluid.core.plugins import make_plugin_manager
from superfluid.core.settings import SchedulerSettings

from .fakes import WAIT, Clock, FakeEngine, LevelSource, StatsObserver


@pytest.fixture(autouse=True)
def lane_fields_owned():
    """Every unit test holds the daemon to the rule of ``core/lane.py``: a lane's fields are
    written by its own methods (the prompt work's by ``core/prompt_work.py``), never by the
    scheduler, the KV manager or a plugin (``core/lane_guard.py``, the same guard the server
    tests' daemons run under). Tests may set lanes up as they like."""
    strays: set[tuple[str, str]] = set()
    uninstall = lane_guard.install(lambda path, name: strays.add((path, name)))
    try:
        yield
    finally:
        uninstall()
    assert not strays, f"lane fields written outside core/lane.py: {sorted(strays)}"


@pytest.fixture(scope="module")
def plugin_manager():
    manager = make_plugin_manager()
    assert manager.has_plugin("qos")
    return manager


@pytest.fixture
def observer(plugin_manager):
    """A StatsObserver registered on the plugin manager for this test."""
    obs = StatsObserver()
    name = f"test-observer-{uuid.uuid4().hex[:8]}"
    plugin_manager.register(obs, name)
    yield obs
    plugin_manager.unregister(obs)


@pytest.fixture
def make(plugin_manager):
    """make(engine=None, *, prefix_cache=False, sources=None, start=True, name=None, **settings)
    -> (loop, engine). Without ``engine`` a FakeEngine with ``max_batch`` lanes (default 4) and,
    with ``prefix_cache``, a prefix cache and parking. ``settings`` are SchedulerSettings fields.
    Every loop is closed afterwards and its thread must have stopped."""
    made: list[tuple[ModelLoop, FakeEngine]] = []

    def factory(engine: FakeEngine | None = None, *, prefix_cache: bool = False, sources=None,
                start: bool = True, name: str | None = None, **settings):
        max_batch = settings.pop("max_batch", 4)
        engine = engine or FakeEngine(max_lanes=max_batch, prefix_cache=prefix_cache)
        config = SchedulerSettings(max_batch=max_batch, context_length=engine.capabilities.context_length,
                                   **settings)
        loop = ModelLoop(name or f"fake-{uuid.uuid4().hex[:8]}", engine, plugin_manager.hook, config,
                         pressure_sources=sources)
        made.append((loop, engine))
        if start:
            loop.start()
        return loop, engine

    yield factory
    for loop, engine in made:
        engine.unblock()
        loop.close(timeout=WAIT)
        assert not loop.running, "model thread did not stop"


def fake_time(clock: Clock) -> SimpleNamespace:
    return SimpleNamespace(monotonic=clock.monotonic, time=time.time, sleep=time.sleep,
                           perf_counter=time.perf_counter)


@pytest.fixture
def stepped(make, monkeypatch):
    """stepped(*, kv_capacity=None, level="ok", **settings) -> (loop (not started), engine,
    LevelSource, Clock) on a FakeEngine with a prefix cache: pressure is read at every tick, and
    the scheduler's and KV manager's clock only moves when the test advances it."""
    clock = Clock()
    monkeypatch.setattr(pressure_mod, "PRESSURE_CHECK_S", 0.0)
    for mod in (kv_room_mod, scheduler_mod):
        monkeypatch.setattr(mod, "time", fake_time(clock))

    def factory(*, kv_capacity=None, level="ok", **settings):
        max_batch = settings.get("max_batch", 4)
        source = LevelSource(level)
        engine = FakeEngine(max_lanes=max_batch, kv_capacity=kv_capacity, prefix_cache=True)
        loop, engine = make(engine, sources=[source], start=False, **settings)
        return loop, engine, source, clock

    return factory


@pytest.fixture
def prefix_clock(monkeypatch):
    """The prefix module's clock, moved by the test (LRU order)."""
    clock = Clock()
    monkeypatch.setattr(prefix_mod, "time", SimpleNamespace(monotonic=clock.monotonic))
    return clock
