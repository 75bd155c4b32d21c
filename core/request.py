"""What a client asked for, independent of the protocol it used to ask."""

from __future__ import annotations

import itertools
import time
from typing import Callable

import attrs

from .media import MediaSpan
from .qos import DEFAULT_CLASS

_ids = itertools.count(1)

#: A set of LoRA adapters with their scales: (name, scale) pairs sorted by name; () is the base model.
AdapterSet = tuple[tuple[str, float], ...]


def new_request_id(prefix: str = "req") -> str:
    return f"{prefix}-{next(_ids):08d}-{int(time.time() * 1000) % 100000:05d}"


#: a JsonChoice ``schema`` that stands for plain text rather than a JSON value: a run of printable
#: characters without ``<`` or a line break (a string parameter in an XML-parameter call, written
#: raw); :func:`text_value` bounds it by a string schema's ``maxLength``
TEXT_VALUE = {"x-superfluid": "text"}


def text_value(schema: dict | None = None) -> dict:
    """The plain-text value for a string parameter whose schema is ``schema``."""
    limit = (schema or {}).get("maxLength")
    return {**TEXT_VALUE, "maxLength": limit} if isinstance(limit, int) and limit > 0 else TEXT_VALUE


def is_text(schema) -> bool:
    """Whether a JsonChoice ``schema`` stands for plain text (:func:`text_value`)."""
    return isinstance(schema, dict) and schema.get("x-superfluid") == "text"


@attrs.define(frozen=True)
class JsonChoice:
    """One way a constrained reply may go: the literal text ``lead``, then one JSON value that
    ``schema`` (a JSON Schema, not to be mutated) accepts (None: no value; :data:`TEXT_VALUE`:
    plain text), then the pieces of ``rest`` in order. ``optional``: as a piece of another
    choice's ``rest``, it may be left out whole (an optional parameter). The schema takes no part
    in the hash, so the value stays hashable (engines cache what they build from it); equality
    compares it."""

    lead: str
    schema: dict | None = attrs.field(hash=False)
    rest: tuple["JsonChoice", ...] = ()
    optional: bool = False


@attrs.define(frozen=True)
class JsonConstraint:
    """Generated text held to JSON Schemas, in terms any engine can implement: one of ``choices``
    (its lead, then a JSON value its schema accepts), then the literal ``tail``, then only
    end-of-generation. A front end describes what it needs this way (a forced tool call's rest
    after its pre-fill: one choice per tool it may name, the call's closing as the tail; a
    response format: one choice with no lead). :mod:`superfluid.core.constrain` turns it into
    one llguidance grammar whose token masks every engine applies. A schema llguidance cannot
    enforce is refused when the request is submitted (``ModelLoop.submit``: a 400
    ``unsupported_schema`` naming the field it came from), never sampled unconstrained."""

    choices: tuple[JsonChoice, ...]
    tail: str = ""


@attrs.define(frozen=True)
class ThinkBudget:
    """A reasoning model's think span held to ``tokens`` tokens. The span opens with ``open``
    (None: the prompt already opened it, as templates that end their generation prompt with
    ``<think>`` do) and closes with ``close``. Once ``tokens`` tokens of thinking are generated,
    only the tokens of ``close`` may follow (the engine samples the end marker next), then the
    answer. The model may close the span earlier. Enforced as a constraint
    (:mod:`superfluid.core.constrain`), so every engine that constrains sampling enforces it, and
    thinking can never eat the reply's ``max_tokens``."""

    tokens: int
    close: str = "</think>"
    open: str | None = "<think>"


@attrs.define(frozen=True)
class SamplingParams:
    """Per-request sampling, applied by the engine's own sampler so that greedy output matches
    the runtime. ``temperature <= 0`` means greedy.

    ``grammar`` (GBNF text, root rule ``root``) constrains the generated tokens: only tokens that
    keep the text after the prompt a prefix of the grammar's language may be sampled, and once
    the grammar is complete only end-of-generation. It applies to the generated tokens only, never
    the prompt; an engine honours it only if ``EngineCapabilities.grammars`` (front ends do not
    send one otherwise). A lane that resumes (preempted, worker restart) must bring the grammar
    back to the state its generated tokens left it in.

    ``json_schema`` constrains the generated tokens the same way, described engine-neutrally
    (:class:`JsonConstraint`) instead of in one engine's grammar syntax; the same capability
    covers it (``EngineCapabilities.grammars``: the engine can constrain sampling). Set at most
    one of the two. Either is enforced by the token-mask library in :mod:`superfluid.core.constrain`
    (llguidance), which every engine shares. ``think_budget`` (:class:`ThinkBudget`) is enforced
    the same way, before the answer (which ``json_schema`` may still hold to a schema).

    ``logit_bias`` adds a value to a token's logit before anything else sees it (OpenAI's
    ``logit_bias``: token id, −100…100). ``logprobs`` asks for the sampled token's log-probability
    and that many of the most likely candidates (0: the sampled token's only; None: none), taken
    from the model's distribution before any bias, constraint, penalty or filter."""

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
    json_schema: JsonConstraint | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: int | None = None
    think_budget: ThinkBudget | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    @property
    def constrained(self) -> bool:
        """A grammar or a JSON constraint holds the sampled tokens: no plain argmax over the raw
        logits."""
        return bool(self.grammar) or self.json_schema is not None or self.think_budget is not None

    @property
    def plain(self) -> bool:
        """Nothing looks at a sampled token's logits row but the sampler itself (no bias, no
        constraint, no logprobs): an engine may keep such lanes on its fastest path."""
        return not (self.constrained or self.logit_bias or self.logprobs is not None)

    @property
    def uses_penalties(self) -> bool:
        return (self.repeat_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)


@attrs.define
class Request:
    """One generation request: prompt tokens, limits, sampling, QoS class and flags.

    ``sink`` receives :class:`~superfluid.core.lane.LaneEvent` objects from the scheduler
    thread; it must not block (front ends hand them to their own event loop).

    ``prompt_logprobs`` (top candidates per position, as ``SamplingParams.logprobs``) scores the
    prompt itself: each prompt token after the first gets its log-probability given the tokens
    before it (a completion's ``echo`` with ``logprobs``). ``embed`` asks for the prompt's pooled
    embedding instead of a generation: the lane prefills, ends with the embedding in its
    "finished" event and samples nothing. Both need every prompt token computed here, so such a
    request is never seeded from cached KV."""

    prompt_tokens: list[int]
    max_tokens: int
    sink: Callable[["object"], None]
    sampling: SamplingParams = attrs.field(factory=SamplingParams)
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    qos: str = DEFAULT_CLASS
    batch_invariant: bool = False
    # the images the prompt holds, at the positions they fill (their placeholders in
    # ``prompt_tokens``, see core/media.py); a lane with media is never preempted
    media: tuple[MediaSpan, ...] = ()
    start_deadline: float | None = None  # monotonic time by which it must be admitted, or fail
    reuse_prefix: bool = True  # may be seeded from the prefix cache (llama.cpp's cache_prompt)
    streamed: bool = False  # the client reads the text as it is committed (not only the whole reply)
    prompt_logprobs: int | None = None
    embed: bool = False
    # With ``embed``: a reranker's lane. The engine pools the prompt as the model's rank pooling
    # says and applies its classification head (ModelInfo.rerank); the final event's
    # ``embedding`` holds the head's outputs as computed (the first is the relevance score), not
    # normalised.
    rank: bool = False
    # The LoRA adapters applied to this request: (name, scale) pairs sorted by name, as the
    # model's adapter table names them; () is the base model. A cached prefix serves only a lane
    # of the same set (KV computed under one adapter is not the KV of another).
    adapters: AdapterSet = ()
    id: str = attrs.field(factory=new_request_id)
    arrived: float = attrs.field(factory=time.monotonic)
    meta: dict = attrs.field(factory=dict)
