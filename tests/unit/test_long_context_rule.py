"""The long-context rule every vocabulary engine shares (core.vocab_engine.context_length and
core.kv_context_options): a max-context past the training window only with rope scaling or with
--allow-long-context (which warns), and rope options refused, naming the engine, by an engine
that does not implement them. Also: the options load from flags and TOML, validated."""

from __future__ import annotations

import logging

import pytest

from superfluid.core.config import ModelConfig
from superfluid.core.engine import EngineCapabilities
from superfluid.core.errors import ConfigError
from superfluid.core.stop_flag import StopFlag
from superfluid.core.vocab_engine import VocabEngine, context_length

from .test_vocab_engine import FakeVocab


def test_past_the_window_is_refused_naming_both_ways_out():
    with pytest.raises(ConfigError) as err:
        context_length("m", 16384, 8192, 8192)
    text = str(err.value)
    assert "max-context 16384 exceeds the model's training context 8192" in text
    assert "--rope-scaling" in text and "--rope-scale 2" in text and "--allow-long-context" in text


def test_rope_scaling_accepts_it_and_allow_long_context_warns(caplog):
    assert context_length("m", 16384, 8192, 8192, rope_scaling=True) == 16384
    with caplog.at_level(logging.WARNING, logger="superfluid.engine"):
        assert context_length("m", 16384, 8192, 8192, allow_long=True) == 16384
    assert any("without rope scaling" in r.getMessage() and r.levelno == logging.WARNING for r in caplog.records)


class Engine(VocabEngine):
    engine_name = "plain"

    def __init__(self, model, vocab):
        self._take_vocab(model, vocab, 8192)
        self.stop_flag = StopFlag()
        self.capabilities = EngineCapabilities(max_lanes=self.max_lanes, context_length=self.max_context)

    def start(self, progress=None):
        pass

    def run_tick(self, plan):
        raise NotImplementedError


class RopeEngine(Engine):
    engine_name = "roped"
    implements_rope_scaling = True


def _model(**values) -> ModelConfig:
    return ModelConfig(name="m", path="m.gguf", engine="fake",
                       values={"max-batch": 1, **{k.replace("_", "-"): v for k, v in values.items()}})


def test_an_engine_without_rope_scaling_refuses_its_options_naming_itself():
    vocab = FakeVocab(n_ctx_train=8192)
    with pytest.raises(ConfigError, match="the plain engine does not implement rope scaling .*--rope-scaling"):
        Engine(_model(max_context=16384, rope_scaling="yarn", rope_scale=2.0), vocab)
    assert vocab.closed
    with pytest.raises(ConfigError, match="plain.*--yarn-beta-fast"):
        Engine(_model(yarn_beta_fast=16.0), FakeVocab(n_ctx_train=8192))
    assert Engine(_model(), FakeVocab(n_ctx_train=8192)).max_context == 8192  # nothing set: nothing refused


def test_an_engine_with_rope_scaling_takes_the_longer_context():
    engine = RopeEngine(_model(max_context=16384, rope_scaling="yarn", rope_scale=2.0), FakeVocab(8192))
    assert engine.max_context == 16384
    with pytest.raises(ConfigError, match="exceeds"):  # rope-scaling none is not scaling
        RopeEngine(_model(max_context=16384, rope_scaling="none"), FakeVocab(8192))
    assert RopeEngine(_model(max_context=16384, allow_long_context=True), FakeVocab(8192)).max_context == 16384


def test_the_options_load_from_flags_and_toml_validated(tmp_path):
    from superfluid.core.cli import load

    config, _ = load(["serve", "--kv-bits", "8", "--rope-scaling", "yarn", "--rope-scale", "2",
                      "--yarn-orig-ctx", "8192", "--allow-long-context"])
    m = config.models[0]
    assert (m["kv-bits"], m["rope-scaling"], m["rope-scale"], m["yarn-orig-ctx"], m["allow-long-context"]) == \
        (8, "yarn", 2.0, 8192, True)
    toml = tmp_path / "s.toml"
    toml.write_text('[[models]]\npath = "x.gguf"\nkv-bits = 4\nrope-scaling = "linear"\nyarn-ext-factor = 0.5\n')
    config, _ = load(["serve", "--config", str(toml)])
    assert (config.models[0]["kv-bits"], config.models[0]["rope-scaling"], config.models[0]["yarn-ext-factor"]) == \
        (4, "linear", 0.5)
    for flags, needle in ((["--kv-bits", "3"], "kv-bits"), (["--rope-scaling", "ntk"], "rope-scaling"),
                          (["--rope-scale", "-2"], "rope-scale")):
        with pytest.raises(ConfigError, match=needle):
            load(["serve", *flags])
