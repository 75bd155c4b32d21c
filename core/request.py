"""What a client asked for, independent of the protocol it used to ask."""

from __future__ import annotations

import itertools
import time
from typing import Callable

import attrs

_ids = itertools.count(1)


def new_request_id(prefix: str = "req") -> str:
    return f"{prefix}-{next(_ids):08d}-{int(time.time() * 1000) % 100000:05d}"


@attrs.define(frozen=True)
class SamplingParams:
    """Per-request sampling, applied by the engine's own sampler so that greedy output matches
    the runtime. ``temperature <= 0`` means greedy.

    ``grammar`` (GBNF text, root rule ``root``) constrains the generated tokens: only tokens that
    keep the text after the prompt a prefix of the grammar's language may be sampled, and once
    the grammar is complete only end-of-generation. It applies to the generated tokens only, never
    the prompt; an engine honours it only if ``EngineCapabilities.grammars`` (front ends do not
    send one otherwise). A lane that resumes (preempted, worker restart) must bring the grammar
    back to the state its generated tokens left it in."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    repeat_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    penalty_last_n: int = 64
    grammar: str | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    @property
    def constrained(self) -> bool:
        """A grammar constrains the sampled tokens: no plain argmax over the raw logits."""
        return bool(self.grammar)

    @property
    def uses_penalties(self) -> bool:
        return (self.repeat_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)


@attrs.define
class Request:
    """One generation request: prompt tokens, limits, sampling, QoS class and flags.

    ``sink`` receives :class:`~superfluid.core.lane.LaneEvent` objects from the scheduler
    thread; it must not block (front ends hand them to their own event loop)."""

    prompt_tokens: list[int]
    max_tokens: int
    sink: Callable[["object"], None]
    sampling: SamplingParams = attrs.field(factory=SamplingParams)
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    qos: str = "agent"
    batch_invariant: bool = False
    media: bool = False  # bound media (images, audio): never preempted
    start_deadline: float | None = None  # monotonic time by which it must be admitted, or fail
    reuse_prefix: bool = True  # may be seeded from the prefix cache (llama.cpp's cache_prompt)
    streamed: bool = False  # the client reads the text as it is committed (not only the whole reply)
    id: str = attrs.field(factory=new_request_id)
    arrived: float = attrs.field(factory=time.monotonic)
    meta: dict = attrs.field(factory=dict)
