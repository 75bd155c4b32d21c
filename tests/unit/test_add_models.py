"""``superfluid_add_models``: a plugin adds a model through the registrar, setting only the keys it
owns or the core's; every other model-scoped option is what its owner declared for an added model
(the first model's value, or the default for ``inherit=False``). The HTTP front end's
``--fim-model`` is such a model."""

from __future__ import annotations

import sys
import types

import pytest

from superfluid.core import cli
from superfluid.core.config import model_registrar
from superfluid.core.errors import ConfigError
from superfluid.core.hookspecs import hookimpl


@pytest.fixture
def fim_file(tmp_path):
    path = tmp_path / "fim.gguf"
    path.write_bytes(b"GGUF")
    return str(path)


def test_the_fim_model_is_the_first_models_values_but_its_lanes_context_and_caps(fim_file):
    config, _ = cli.load(["serve", "--model", "/m/chat.gguf", "--max-batch", "6", "--class-lanes", "background=2",
                          "--park", "--threads", "3", "--kv-unified", "--kv-pool-cells", "9000", "--max-context", "4096",
                          "--fim-model", fim_file, "--fim-max-batch", "1", "--fim-max-context", "2048"])
    first, fim = config.models
    assert (fim.name, fim.path, fim.engine) == ("fim", fim_file, first.engine)
    # exactly what the front end configured before the registrar: the first model's values,
    # with its own lanes and context and no class lane caps
    assert fim.values == {**first.values, "max-batch": 1, "max-context": 2048, "class-lanes": {}}
    assert first.values["class-lanes"] == {"background": 2} and first.values["max-batch"] == 6


def test_without_fim_model_nothing_is_added():
    config, _ = cli.load(["serve", "--model", "/m/chat.gguf"])
    assert [m.name for m in config.models] == ["chat"]


def test_fim_model_refusals_stay(fim_file, tmp_path):
    with pytest.raises(ConfigError, match="--fim-model: file not found"):
        cli.load(["serve", "--fim-model", str(tmp_path / "missing.gguf")])
    toml = tmp_path / "s.toml"
    toml.write_text('[[models]]\nname = "fim"\npath = "/x.gguf"\n')
    with pytest.raises(ConfigError, match="already named 'fim'"):
        cli.load(["serve", "--config", str(toml), "--fim-model", fim_file])


@pytest.fixture
def adder(monkeypatch):
    """A TOML-listed plugin whose superfluid_add_models runs ``ADD(register, config)``."""
    module = types.ModuleType("sf_test_adder")
    calls = []

    @hookimpl
    def superfluid_add_models(register, config):
        calls.append([m.name for m in config.models])
        for name, path, values in module.ADD:
            register(name, path, values)

    @hookimpl
    def superfluid_configure(config):
        calls.append(("configure", [m.name for m in config.models]))

    module.superfluid_add_models, module.superfluid_configure, module.ADD = superfluid_add_models, superfluid_configure, []
    monkeypatch.setitem(sys.modules, module.__name__, module)
    return module, calls


def load_with(tmp_path, adder, *flags):
    toml = tmp_path / "a.toml"
    toml.write_text(f'plugins = ["{adder[0].__name__}"]\n')
    return cli.load(["serve", "--config", str(toml), "--model", "/m/a.gguf", *flags])[0]


def test_a_plugin_adds_a_model_before_configure_sees_them(tmp_path, adder):
    adder[0].ADD = [("extra", "/m/extra.gguf", {"max-batch": 2, "engine": "basert"})]
    config = load_with(tmp_path, adder, "--class-lanes", "agent=4", "--pressure-high", "0.9")
    a, extra = config.models
    assert (extra.name, extra.engine, extra["max-batch"], extra["pressure-high"]) == ("extra", "basert", 2, 0.9)
    assert extra["class-lanes"] == {} and a["class-lanes"] == {"agent": 4}  # caps: not inherited (qos's choice)
    assert adder[1] == [["a"], ("configure", ["a", "extra"])]


@pytest.mark.parametrize("values, needle", [
    ({"max-batch": 0}, "model 'extra': max-batch must be between 1 and 256"),
    ({"no-such-key": 1}, "unknown model key 'no-such-key'"),
    ({"host": "0.0.0.0"}, "unknown model key 'host'"),  # not model-scoped
    ({"class-lanes": "agent=x"}, "model 'extra': class-lanes"),
])
def test_registered_values_are_validated(tmp_path, adder, values, needle):
    adder[0].ADD = [("extra", "/m/extra.gguf", values)]
    with pytest.raises(ConfigError, match=needle):
        load_with(tmp_path, adder)


def test_a_taken_name_is_refused(tmp_path, adder):
    adder[0].ADD = [("a", "/m/other.gguf", None)]
    with pytest.raises(ConfigError, match="already named 'a'"):
        load_with(tmp_path, adder)


def test_a_config_without_its_schema_cannot_add():
    from superfluid.core.config import Config
    with pytest.raises(ConfigError, match="without its Schema"):
        model_registrar(Config(values={}, models=[], plugins=[]))
