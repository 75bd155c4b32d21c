"""A model's LoRA adapters loaded and unloaded at runtime through the tick plan, on a running
loop (its own thread) with a FAKE engine (tests/unit/fake_lora.py): a load's answer is the
engine's (TickResult.adapter_errors), an unload refuses new requests at once, lets the lanes
under it finish with nothing lost, and only then reaches the engine."""

from __future__ import annotations

import threading

import pytest

from superfluid.core.adapters import AdapterNotFound, parse_lora
from superfluid.core.errors import ConfigError, EngineFailure

from .fake_lora import FakeLoraEngine, expected_under
from .fakes import FakeEngine, submit, wait_for

A = (("a", 1.0),)


def _file(tmp_path, name):
    path = tmp_path / f"{name}.gguf"
    path.write_bytes(b"fake")
    return str(path)


def test_load_is_answered_by_the_engine(make, tmp_path):
    engine = FakeLoraEngine(max_lanes=2, fail_loads={"bad": "not a LoRA of this model"})
    loop, engine = make(engine, max_batch=2)
    adapter = loop.load_adapter("a", _file(tmp_path, "a"), 0.5)
    assert adapter.id == 0 and adapter.scale == 0.5 and "a" in engine.loaded
    with pytest.raises(EngineFailure, match="not a LoRA of this model"):
        loop.load_adapter("bad", _file(tmp_path, "bad"))
    assert [a.name for a in loop.adapters.served()] == ["a"]  # the failed one is unknown, as before
    with pytest.raises(ConfigError, match="does not exist"):
        loop.load_adapter("c", str(tmp_path / "missing.gguf"))
    _, sink = submit(loop, [3] * 30, 5, adapters=A)
    assert sink.wait().kind == "finished" and sink.token_ids == expected_under([3] * 30, 5, A)
    assert loop.load_adapter("b", _file(tmp_path, "b")).id == 2  # the failed one's id 1 is not reused
    assert engine.errors == []


def test_unload_under_traffic_loses_nothing(make, tmp_path):
    engine = FakeLoraEngine(max_lanes=2)
    loop, engine = make(engine, max_batch=2)
    loop.load_adapter("a", _file(tmp_path, "a"))
    engine.block(after=1)  # hold the lanes' second tick, so they are still running
    running = [submit(loop, [10 + i] * 20, 50, adapters=A)[1] for i in range(3)]  # two run, one waits
    assert wait_for(engine.holding.is_set)
    done = []
    unloader = threading.Thread(target=lambda: done.append(loop.unload_adapter("a", timeout=5)))
    unloader.start()
    assert wait_for(lambda: loop.adapters.get("a") is None)
    with pytest.raises(AdapterNotFound):  # new requests: 404 from now on
        submit(loop, [9] * 20, 5, adapters=A)
    assert ("unload", "a") not in engine.load_log
    engine.unblock()
    unloader.join(10)
    assert done == [True]
    for i, sink in enumerate(running):
        assert sink.wait().kind == "finished"
        assert sink.token_ids == expected_under([10 + i] * 20, 50, A)
    assert engine.load_log[-1] == ("unload", "a") and "a" not in engine.loaded
    assert engine.errors == []


def test_an_engine_without_adapters_refuses_them(make, tmp_path):
    loop, _ = make(FakeEngine(max_lanes=1), max_batch=1)
    with pytest.raises(Exception, match="serves no LoRA adapters"):
        loop.load_adapter("a", _file(tmp_path, "a"))


@pytest.mark.parametrize("text, name, path, scale", [
    ("a=/x/a.gguf", "a", "/x/a.gguf", 1.0),
    ("sql = /x/sql.gguf:0.25", "sql", "/x/sql.gguf", 0.25),
    ("b=C:/weird:path/b.gguf", "b", "C:/weird:path/b.gguf", 1.0),
])
def test_parse_lora(text, name, path, scale):
    spec = parse_lora(text)
    assert (spec.name, spec.path, spec.scale) == (name, path, scale)


@pytest.mark.parametrize("text", ["a", "=x.gguf", "a:b=x.gguf", "a="])
def test_parse_lora_refuses(text):
    with pytest.raises(ConfigError):
        parse_lora(text)


def test_lora_flag_and_toml_list(tmp_path):
    from superfluid.core.cli import load
    from superfluid.core.config import CORE_OPTIONS

    config, _ = load(["serve", "--lora", "a=/p/a.gguf:0.5", "--lora", "b=/p/b.gguf"])
    assert [(s.name, s.path, s.scale) for s in CORE_OPTIONS.of(config.models[0]).lora] == [
        ("a", "/p/a.gguf", 0.5), ("b", "/p/b.gguf", 1.0)]
    toml = tmp_path / "superfluid.toml"
    toml.write_text('[[models]]\nname = "m"\npath = "/p/m.gguf"\nlora = ["sql=/p/sql.gguf:0.8"]\n')
    config, _ = load(["serve", "--config", str(toml)])
    assert [(s.name, s.scale) for s in CORE_OPTIONS.of(config.models[0]).lora] == [("sql", 0.8)]
    with pytest.raises(ConfigError, match="more than once"):
        load(["serve", "--lora", "a=/p/a.gguf", "--lora", "a=/p/b.gguf"])


def test_request_adapters_by_name_field_and_global_scales(tmp_path):
    """plugins/http/lora.py's selection on a real adapter table: MODEL:NAME, llama-server's lora
    field (ids or names; unlisted adapters scale 0; scale 0 leaves one out), and the global
    scales POST /lora-adapters sets for requests naming the base model alone."""
    from types import SimpleNamespace

    from superfluid.core.adapters import AdapterTable
    from superfluid.core.errors import InvalidRequest
    from superfluid.plugins.http.lora import request_adapters

    table = AdapterTable("m")
    for name, scale in (("a", 0.5), ("b", 1.0)):
        table.add(name, _file(tmp_path, name), scale)
    table.fill_plan(SimpleNamespace(load_adapters=[], unload_adapters=[]), set())
    table.tick_done({})
    rt = SimpleNamespace(name="m", loop=SimpleNamespace(adapters=table))
    assert request_adapters(rt, "m", None) == ()
    assert request_adapters(rt, "m:a", None) == (("a", 0.5),)
    assert request_adapters(rt, "m", [{"id": 1, "scale": 2.0}, {"id": "a"}]) == (("a", 0.5), ("b", 2.0))
    assert request_adapters(rt, "m:a", [{"id": 0, "scale": 0}]) == ()
    with pytest.raises(InvalidRequest, match="no LoRA adapter 7"):
        request_adapters(rt, "m", [{"id": 7}])
    table.set_global({1: 0.25})
    assert request_adapters(rt, "m", None) == (("b", 0.25),)
    assert request_adapters(rt, "m", []) == ()  # an empty field: no adapter, as in llama-server
