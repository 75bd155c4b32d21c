"""The engine adapter interface: what the scheduler needs from a runtime, and the registry
that engine plugins fill through ``superfluid_add_engines``."""

from __future__ import annotations

import abc
from typing import Callable

import attrs

from .errors import ConfigError
from .media import VisionInfo
from .tick import TickPlan, TickResult


@attrs.define(frozen=True)
class EngineCapabilities:
    """What an engine declares so policies can plan for it without knowing it.

    ``tick_target_free_ms`` is the tick length while a lane is free or finishing;
    ``tick_target_busy_cap_ms`` caps ``--tick-target-ms`` while every lane is busy."""

    max_lanes: int
    context_length: int
    stops_mid_tick: bool = True
    uniform_decode_rounds: bool = True
    supports_parking: bool = False
    persists_kv: bool = False   # parked KV can be saved to and loaded from files (TickPlan.save/load)
    prefix_cache: bool = False  # a slot's KV can be kept, cut and copied to seed a new lane
    aborts_mid_step: bool = False  # a stop request interrupts even the engine step in flight
    grammars: bool = False      # constrained sampling: honours SamplingParams.grammar (GBNF) and .json_schema
    logprobs: bool = False      # returns SamplingParams.logprobs per sampled token and scores prompts (LanePlan.targets)
    logit_bias: bool = False    # honours SamplingParams.logit_bias
    embeddings: bool = False    # runs embedding lanes (Request.embed, LanePlan.embed)
    generates: bool = True      # False: an embedding-only model, which samples nothing
    vision: bool = False        # takes images: feeds LanePlan.media rows; ModelInfo.vision says how they are laid out
    # A vision-language model served for its language half only (vision False): why, in the
    # engine's words, naming the engine, the family and who serves its images. Requests with
    # images are refused with it (code images_not_served) rather than as a text-only model's.
    images_not_served: str | None = None
    # A step costs more the wider the range of slot ids its lanes span (llama.cpp's per-sequence
    # KV buffers: attention covers every buffer from the lowest slot in the batch to the highest),
    # so the KV manager keeps busy lanes in neighbouring slots.
    compact_slots: bool = False
    # KV slots beyond the lanes: the engine holds slot ids 0 .. max_lanes + spare_slots - 1, and
    # the KV manager binds a lane to any free one while never running more than max_lanes lanes.
    # A free slot keeps its finished lane's KV as a cached prefix, so the spare slots keep the most
    # recently finished conversations in the pool, where a returning one is seeded in place rather
    # than loaded from host memory (llama.cpp: its two sequences beyond the lanes).
    spare_slots: int = 0
    # Lanes and cached prefixes draw their cells from one pool (llama.cpp's unified KV: sliding-
    # window and recurrent models, --kv-unified), so a cached prefix takes cells a lane could use:
    # the KV manager keeps at most one lane's context (context_length cells) of cached prefixes
    # in it and moves the rest, oldest first, to host memory. False: each slot's KV has room of
    # its own, and a cached prefix costs no lane anything while it waits.
    shared_pool: bool = False
    # LoRA adapters (TickPlan.load_adapters, LanePlan.adapters): "none" (not served); "per_tick"
    # (an adapter set applies to the whole engine step, as llama.cpp applies one to a context, so
    # the scheduler puts only lanes of one set in a tick); "per_row" (rows of different sets share
    # one step: basert).
    adapters: str = "none"
    prefill_step_tokens: int = 512
    tick_target_free_ms: float = 50.0
    tick_target_busy_cap_ms: float = 250.0


@attrs.define(frozen=True)
class RerankFormat:
    """A reranker's (query, document) pair as its prompt, built the way llama-server builds it:
    ``template`` with ``{query}`` and ``{document}`` in it (a GGUF's
    ``tokenizer.chat_template.rerank``: Qwen3-Reranker), else the tokens ``prefix`` query
    ``middle`` document ``suffix`` (BERT-style: BOS query EOS SEP document EOS, as the
    vocabulary adds them). The head's first output is the pair's score."""

    template: str | None = None
    prefix: tuple[int, ...] = ()
    middle: tuple[int, ...] = ()
    suffix: tuple[int, ...] = ()


@attrs.define(frozen=True)
class ModelInfo:
    """Tokenizer-level facts a front end needs: chat template, special tokens, FIM tokens."""

    name: str
    path: str
    chat_template: str | None = None
    bos_token: str = ""
    eos_token: str = ""
    bos_id: int | None = None
    add_bos: bool = False
    fim_prefix: int | None = None
    fim_suffix: int | None = None
    fim_middle: int | None = None
    n_vocab: int = 0
    n_ctx_train: int = 0
    n_embd: int = 0  # the width of an embedding (the model's hidden size)
    vision: VisionInfo | None = None  # how an image enters a prompt (a model that takes images)
    # A reranker (its engine runs Request.rank lanes through its classification head): how a
    # pair becomes its prompt. None: not served as a reranker (/v1/rerank refuses it).
    rerank: RerankFormat | None = None


class Engine(abc.ABC):
    """One loaded model. Tokenizing happens in the daemon; ticks may run elsewhere (a worker)."""

    capabilities: EngineCapabilities
    info: ModelInfo

    @abc.abstractmethod
    def start(self, progress: Callable[[str], None] | None = None) -> None:
        """Load the model (and start any worker). Blocks until the engine can run ticks."""

    @abc.abstractmethod
    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = True) -> list[int]:
        ...

    @abc.abstractmethod
    def token_bytes(self, token: int) -> bytes:
        """The bytes a token contributes to output text (special tokens render as nothing)."""

    @abc.abstractmethod
    def run_tick(self, plan: TickPlan) -> TickResult:
        """Run one tick. Called only from the model's thread (its ModelLoop)."""

    @abc.abstractmethod
    def request_stop(self) -> None:
        """Ask the tick in flight to end at the engine's next step. Safe from any thread."""

    def request_yield(self) -> None:
        """Ask the tick in flight to end once its engine step in flight is done (so nothing
        computed is thrown away). Safe from any thread. Engines that cannot tell the two apart
        stop as :meth:`request_stop` does."""
        self.request_stop()

    @abc.abstractmethod
    def clear_stop(self) -> None:
        """Reset the stop and yield requests before the next tick."""

    @abc.abstractmethod
    def close(self) -> None:
        ...

    def restart(self, progress: Callable[[str], None] | None = None) -> None:
        """Start the engine afresh after it crashed (its KV, parked state included, is gone).
        Engines that cannot restart leave this as is: their lanes fail instead."""
        raise NotImplementedError

    def describe(self) -> dict:
        """Extra facts for /health (worker pid, state)."""
        return {}


EngineFactory = Callable[..., Engine]


class EngineRegistry:
    """Engine factories by name. ``superfluid_add_engines`` hands plugins its :meth:`add`."""

    def __init__(self) -> None:
        self._factories: dict[str, EngineFactory] = {}

    def add(self, name: str, factory: EngineFactory) -> None:
        if name in self._factories:
            raise ValueError(f"engine {name!r} registered twice")
        self._factories[name] = factory

    def names(self) -> list[str]:
        return sorted(self._factories)

    def create(self, name: str, **kwargs) -> Engine:
        try:
            factory = self._factories[name]
        except KeyError:
            raise ConfigError(f"unknown engine {name!r}; installed engines: {', '.join(self.names()) or 'none'}")
        return factory(**kwargs)
