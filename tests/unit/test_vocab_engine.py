"""core.vocab_engine, the base of the engines that own a vocabulary (llama.cpp, MLX, basert): the
context rule they share, a failed rule leaving nothing open, and the stop requests reaching the
engine's stop flag."""

from __future__ import annotations

import pytest

from superfluid.core.config import ModelConfig
from superfluid.core.engine import EngineCapabilities, ModelInfo
from superfluid.core.errors import ConfigError
from superfluid.core.stop_flag import StopFlag
from superfluid.core.vocab_engine import VocabEngine, context_length


@pytest.mark.parametrize("requested,train,want", [
    (0, 32768, 8192),   # not set: the smaller of the training context and the engine's default
    (0, 2048, 2048),
    (0, 0, 8192),       # training context unknown: the engine's default
    (16384, 32768, 16384),
    (8192, 0, 8192),
])
def test_max_context_defaults_to_the_smaller_of_training_and_default(requested, train, want):
    assert context_length("m", requested, train, 8192) == want


@pytest.mark.parametrize("train", [2048, 0])
def test_max_context_past_the_training_context_is_refused(train):
    with pytest.raises(ConfigError, match=f"model 'm': max-context 9000 exceeds the model's training context "
                                          f"{train or 8192}"):
        context_length("m", 9000, train, 8192)


class FakeVocab:
    def __init__(self, n_ctx_train: int):
        self.info = ModelInfo(name="m", path="m.gguf", n_ctx_train=n_ctx_train)
        self.closed = False

    def tokenize(self, text, add_special, parse_special):
        return [ord(c) for c in text] + ([0] if add_special else [])

    def token_bytes(self, token):
        return bytes([token])

    def close(self):
        self.closed = True


class InProcessEngine(VocabEngine):
    def __init__(self, model, vocab):
        self._take_vocab(model, vocab, 4096)
        self.stop_flag = StopFlag()
        self.capabilities = EngineCapabilities(max_lanes=self.max_lanes, context_length=self.max_context)

    def start(self, progress=None):
        pass

    def run_tick(self, plan):
        raise NotImplementedError


def model(max_context: int) -> ModelConfig:
    return ModelConfig(name="m", path="m.gguf", engine="fake", values={"max-context": max_context, "max-batch": 3})


def test_the_base_settles_context_and_lanes_and_serves_the_vocabulary():
    vocab = FakeVocab(n_ctx_train=2048)
    engine = InProcessEngine(model(0), vocab)
    assert (engine.max_context, engine.max_lanes, engine.info) == (2048, 3, vocab.info)
    assert engine.tokenize("ab") == [97, 98, 0] and engine.tokenize("ab", add_special=False) == [97, 98]
    assert engine.token_bytes(97) == b"a"
    engine.close()
    assert vocab.closed


def test_a_context_the_model_cannot_take_closes_the_vocabulary():
    vocab = FakeVocab(n_ctx_train=2048)
    with pytest.raises(ConfigError, match="exceeds"):
        InProcessEngine(model(4096), vocab)
    assert vocab.closed


def test_stop_and_yield_requests_raise_the_engines_stop_flag():
    engine = InProcessEngine(model(0), FakeVocab(n_ctx_train=0))
    engine.request_yield()
    assert engine.stop_flag.stop_requested() and not engine.stop_flag.abort_requested()
    engine.request_stop()
    assert engine.stop_flag.abort_requested()
    engine.clear_stop()
    assert not engine.stop_flag.stop_requested()
