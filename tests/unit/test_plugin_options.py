"""Options owned by their plugin: the schema records who declared each option, every plugin reads
its own back as one frozen, typed object (``PluginOptions.of``), and no plugin's source names an
option another plugin declared (a knob two plugins share is the core's)."""

from __future__ import annotations

import ast
from pathlib import Path

import attrs
import pytest

from superfluid.core.cli import declare_options, load
from superfluid.core.config import CORE_OPTIONS, Config, ModelConfig
from superfluid.core.options import CORE, Option, PluginOptions, Schema
from superfluid.core.plugins import make_plugin_manager
from superfluid.core.settings import SchedulerSettings
from superfluid.plugins.fleet.config import REFUSED
from superfluid.plugins.http.options import OPTIONS as HTTP
from superfluid.plugins.qos.options import OPTIONS as QOS

PLUGINS = Path(__file__).resolve().parents[2] / "plugins"
BUILT_INS = ("qos", "llamacpp", "mlx", "http", "pressure", "basert", "fleet", "kvevents")
# Receivers whose subscript or .get() reads an option value: a one-word key ("device", "host") is
# an option read only there (elsewhere it is any dict's key, an MLX worker's "device").
READERS = {"config", "cfg", "values", "model", "mc", "extra", "settings", "opts"}
# The fleet head names the node settings the spec has it refuse (a `superfluid fleet` flag is
# never a serve option); it reads none of them.
REFUSALS = {("fleet", key) for spellings in REFUSED.values() for key in spellings}


def schema() -> Schema:
    return declare_options(make_plugin_manager())


# ---- who declared what ---------------------------------------------------------------------------

def test_every_option_has_its_owner():
    s = schema()
    owners = {s.owner(name) for name in s.options}
    assert None not in owners, [n for n in s.options if s.owner(n) is None]
    assert owners <= {CORE, *BUILT_INS, "fair_share"}, owners
    for name in ("max-batch", "kv-pool-cells", "kv-bits", "kv-events-block-size", "host", "port"):
        assert s.owner(name) == CORE, name  # shared knobs are the core's
    assert (s.owner("class-lanes"), s.owner("fim-model"), s.owner("kv-unified")) == ("qos", "http", "llamacpp")
    assert (s.owner("kv-events-topic"), s.owner("speculate"), s.owner("os-pressure")) == ("kvevents", "basert", "pressure")


def test_an_option_is_declared_once():
    s = Schema()
    CORE_OPTIONS.declare(s)
    with pytest.raises(ValueError, match="declared twice"):
        s.add(Option("max-batch", int, 1, "again"), owner="someone")


# ---- the sources: no plugin names another plugin's option ---------------------------------------

def foreign_keys(source: str, own: str, s: Schema) -> list[str]:
    """The options of other plugins (not the core's, not ``own``'s) that ``source`` names."""
    names = {}
    for name in s.options:
        owner = s.owner(name)
        if owner not in (CORE, own) and (own, name) not in REFUSALS:
            names.update({name: name, "--" + name: name, "--no-" + name: name})
    found = []
    for node in ast.walk(ast.parse(source)):
        key = None
        if isinstance(node, ast.Subscript):
            key, receiver = node.slice, node.value
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get" and node.args:
            key, receiver = node.args[0], node.func.value
        for const in ([key] if key is not None else []) + [n for n in [node] if isinstance(n, ast.Constant)]:
            if not (isinstance(const, ast.Constant) and isinstance(const.value, str)) or const.value not in names:
                continue
            name = names[const.value]
            read = const is key and _last_name(receiver) in READERS
            if "-" in name or read:
                found.append(name)
    return sorted(set(found))


def _last_name(node) -> str:
    if isinstance(node, ast.Attribute):
        return node.attr
    return node.id if isinstance(node, ast.Name) else ""


def test_the_scanner_finds_a_foreign_key():
    s = schema()
    assert foreign_keys('values["class-lanes"] = {}', "http", s) == ["class-lanes"]
    assert foreign_keys('n = model.values.get("kv-unified", 0) or 0', "basert", s) == ["kv-unified"]
    assert foreign_keys('b = config.get("kv-events-topic")', "http", s) == ["kv-events-topic"]
    assert foreign_keys('d = config["device"]', "llamacpp", s) == ["device"]  # basert's, read
    assert foreign_keys('d = info["device"]', "mlx", s) == []                # a message's field
    assert foreign_keys('x = config["class-lanes"]', "qos", s) == []         # its own
    assert foreign_keys('x = config["max-batch"]', "http", s) == []          # the core's


@pytest.mark.parametrize("plugin", BUILT_INS)
def test_no_plugin_names_another_plugins_option(plugin):
    s = schema()
    offences = {}
    for path in sorted((PLUGINS / plugin).rglob("*.py")):
        found = foreign_keys(path.read_text(encoding="utf-8"), plugin, s)
        if found:
            offences[str(path.relative_to(PLUGINS))] = found
    assert not offences, f"{plugin} names options other plugins own: {offences}"


def test_the_fleets_refusals_are_real_node_options():
    s = schema()
    for flag, spellings in REFUSED.items():
        name = flag.removeprefix("--no-").removeprefix("--")
        assert s.owner(name) in ("qos", "http"), flag
        assert name in spellings


# ---- the typed object --------------------------------------------------------------------------

def test_of_a_config_a_model_and_settings():
    config, _ = load(["serve", "--class-lanes", "background=2", "--completion-burst", "7", "--max-batch", "4"])
    http = HTTP.of(config)
    assert type(http).__name__ == "HttpOptions" and attrs.has(type(http))
    assert (http.completion_burst, http.http_default_qos, http.fim_model) == (7, "agent", None)
    assert HTTP.of(config) is http and HTTP.of(http) is http  # built once; an object passes through
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        http.completion_burst = 1
    model = config.models[0]
    assert QOS.of(model).class_lanes == {"background": 2}
    assert QOS.of(SchedulerSettings(extra=dict(model.values))).class_lanes == {"background": 2}
    core = CORE_OPTIONS.of(model)
    assert (core.max_batch, core.kv_pool_cells, type(core).__name__) == (4, 0, "CoreModelOptions")
    assert not hasattr(core, "host")  # a model has only the model-scoped options
    assert CORE_OPTIONS.of(config).host == "127.0.0.1"
    with pytest.raises(TypeError, match="no model-scoped option"):
        HTTP.of(model)


def test_missing_values_read_as_defaults():
    assert QOS.of(SchedulerSettings()).class_lanes == {}
    assert QOS.of(ModelConfig("m", "", "fake", {"max-batch": 2})).class_lanes == {}
    assert HTTP.of({"completion-burst": 3}).completion_burst == 3
    assert HTTP.of({"fim-model": None}).completion_rate == "10/s"
    assert CORE_OPTIONS.of(Config(values={}, models=[], plugins=[])).port == 8080


def test_a_model_reads_its_own_table():
    config, _ = load(["serve", "--model", "/a.gguf"])
    a = ModelConfig("b", "/b.gguf", "llamacpp", {**config.models[0].values, "max-batch": 3})
    assert (CORE_OPTIONS.of(config.models[0]).max_batch, CORE_OPTIONS.of(a).max_batch) == (8, 3)


def test_the_class_is_made_from_the_declarations():
    opts = PluginOptions("my-plugin", [Option("long-prompt", int, 2048, "h", model_scoped=True),
                                       Option("my-switch", bool, False, "h")])
    assert [o.name for o in opts] == ["long-prompt", "my-switch"]
    assert [f.name for f in attrs.fields(opts.cls)] == ["long_prompt", "my_switch"]
    assert [f.type for f in attrs.fields(opts.cls)] == [int, bool]
    assert [f.name for f in attrs.fields(opts.model_cls)] == ["long_prompt"]
    assert opts.cls.__name__ == "MyPluginOptions"
    s = Schema()
    opts.declare(s)
    assert s.owner("long_prompt") == "my-plugin"
