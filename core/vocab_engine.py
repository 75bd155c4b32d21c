"""The engine base for engines that tokenize in the daemon with a vocabulary they own, whether
their ticks run in a worker process (``core.worker_process.WorkerEngine``: llama.cpp, MLX) or on
the model's thread (basert). It holds what those engines share and nothing about where ticks
run: the vocabulary, the context and lane rule read from the model's options, and the stop flag
the daemon raises."""

from __future__ import annotations

import logging
from typing import Protocol

from .config import CORE_OPTIONS
from .engine import Engine, ModelInfo
from .errors import ConfigError
from .kv_context_options import refuse_rope_scaling, rope_scaling_on
from .stop_flag import StopFlag

log = logging.getLogger("superfluid.engine")


class Vocabulary(Protocol):
    """What the base needs of a tokenizer (the vocab plugin's GGUF and Hugging Face ones)."""

    info: ModelInfo

    def tokenize(self, text: str, add_special: bool, parse_special: bool) -> list[int]: ...

    def token_bytes(self, token: int) -> bytes: ...

    def close(self) -> None: ...


def context_length(name: str, requested: int, n_ctx_train: int, default: int, *, rope_scaling: bool = False,
                   allow_long: bool = False) -> int:
    """A model's max-context: ``requested`` (0: not set) may exceed its training context
    (unknown: ``default``) only with rope scaling on (``rope_scaling``: the positions are
    stretched to reach it) or with ``allow_long`` (``--allow-long-context``: served unscaled, with
    a warning, since the model's output degrades past its window); when not set it is the smaller
    of the two."""
    train = n_ctx_train or default
    if requested and requested > train:
        if rope_scaling:
            log.info("model %s: max-context %d beyond the training context %d, reached by rope scaling",
                     name, requested, train)
        elif allow_long:
            log.warning("model %s: max-context %d exceeds the model's training context %d without rope scaling "
                        "(--allow-long-context): past %d tokens the model's output degrades", name, requested,
                        train, train)
        else:
            raise ConfigError(f"model {name!r}: max-context {requested} exceeds the model's training context "
                              f"{train}; to serve it, turn rope scaling on (--rope-scaling yarn or linear, "
                              f"with --rope-scale {-(-requested // train)}) or accept an unscaled long context "
                              "with --allow-long-context")
    return requested or min(train, default)


class VocabEngine(Engine):
    """A subclass calls :meth:`_take_vocab` in its constructor and sets ``stop_flag`` (a
    :class:`StopFlag` it hands to its runner, or its worker's shared one); tokenizing, the stop
    and yield requests and closing the vocabulary are then done."""

    vocab: Vocabulary
    max_context: int
    max_lanes: int
    stop_flag: StopFlag
    implements_rope_scaling: bool = False
    """Whether the engine applies the rope/YaRN options (core.kv_context_options); one that does
    not refuses them at start, naming itself."""

    def _take_vocab(self, model, vocab: Vocabulary, default_max_context: int) -> None:
        """Keep the vocabulary and settle the model's context (:func:`context_length`) and lanes
        (``max-batch``) from its options. A context the model cannot take closes the vocabulary
        and raises ConfigError, so a model that fails here holds nothing."""
        core = CORE_OPTIONS.of(model)
        try:
            if not self.implements_rope_scaling:
                refuse_rope_scaling(core, getattr(self, "engine_name", type(self).__name__), model.name)
            self.max_context = context_length(model.name, core.max_context, vocab.info.n_ctx_train,
                                              default_max_context, rope_scaling=rope_scaling_on(core),
                                              allow_long=bool(core.allow_long_context))
        except ConfigError:
            vocab.close()
            raise
        self.vocab = vocab
        self.info = vocab.info
        self.max_lanes = core.max_batch

    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = True) -> list[int]:
        return self.vocab.tokenize(text, add_special, parse_special)

    def token_bytes(self, token: int) -> bytes:
        return self.vocab.token_bytes(token)

    def request_stop(self) -> None:
        self.stop_flag.request_stop()

    def request_yield(self) -> None:
        self.stop_flag.request_yield()

    def clear_stop(self) -> None:
        self.stop_flag.clear()

    def close(self) -> None:
        self.vocab.close()
