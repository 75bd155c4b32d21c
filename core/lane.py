"""A lane: one generation bound to one engine sequence slot, and the events it sends out."""

from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING

import attrs

from .request import Request
from .textstream import TextStream
from .tick import OWN, Seed

if TYPE_CHECKING:
    from .kv import Binding, Release


class LaneState(enum.Enum):
    QUEUED = "queued"
    PREFILLING = "prefilling"
    DECODING = "decoding"
    PREEMPTED = "preempted"
    FINISHED = "finished"
    CANCELLED = "cancelled"


@attrs.define(eq=False)
class Lane:
    """The scheduler's view of one generation.

    ``tokens`` is prompt + generated. The engine's KV for this lane holds ``tokens[:n_cached]``;
    what remains (``tokens[n_cached:]``) is fed next, and the engine samples once the feed reaches
    the end. A decoding lane therefore always has exactly one token left to feed: the last one
    sampled. Resuming after a dropped KV is just ``n_cached = 0``.

    Its fields change only through its methods, each named for what happened to it, so this one
    file says how ``slot``, ``n_cached`` or ``n_reused`` can change. The scheduler calls them: it
    applies what the KV manager decided (a :class:`~superfluid.core.kv.Binding`, a
    :class:`~superfluid.core.kv.Release`) and what a tick did. The prompt work's own fields
    (``prompt_logprobs``, ``scores_sent``, ``embedding_sum``, ``pooled``) are written by
    ``core/prompt_work.py`` alone, the module that keeps and reads them."""

    request: Request
    text: TextStream
    tokens: list[int] = attrs.field(init=False)
    n_prompt: int = attrs.field(init=False)
    state: LaneState = LaneState.QUEUED
    slot: int | None = None
    n_cached: int = 0
    queued_at: float = attrs.field(factory=time.monotonic)
    admitted_at: float | None = None
    first_token_at: float | None = None
    finished_at: float | None = None
    finish_reason: str | None = None
    cancel_requested: bool = False
    waited_ticks: int = 0
    # ticks since a lane of its LoRA adapter set last ran (engines that run one set per tick:
    # written by core/adapter_groups.py before each plan, read by the grouping policy)
    group_waited: int = 0
    n_prefilled: int = 0   # prompt tokens the engine actually prefilled for this lane
    n_output: int = 0      # generated tokens that count toward usage (EOS excluded)
    needs_reset: bool = True  # the engine must clear the slot and start a fresh sampler
    parked: str | None = None  # key of this lane's KV parked in the engine's host memory
    parked_tokens: int = 0     # how many of ``tokens`` that parked KV holds
    seed: Seed = OWN  # where the slot's first n_cached tokens of KV come from at the next reset
    n_reused: int = 0          # prompt tokens taken from the prefix cache instead of prefilled
    preemptions: int = 0
    prompt_logprobs: dict = attrs.field(factory=dict)  # prompt position -> its TokenLogprob (scored prompts)
    scores_sent: bool = False  # the "scored" event went out
    embedding_sum: object = None  # an embedding lane: the sum of its prompt's hidden states so far
    pooled: int = 0               # how many prompt tokens that sum holds

    def __attrs_post_init__(self):
        self.tokens = list(self.request.prompt_tokens)
        self.n_prompt = len(self.tokens)

    @property
    def id(self) -> str:
        return self.request.id

    @property
    def qos(self) -> str:
        return self.request.qos

    @property
    def n_generated(self) -> int:
        return len(self.tokens) - self.n_prompt

    @property
    def to_feed(self) -> int:
        """Tokens not yet in the engine's KV (the last sampled token included)."""
        return len(self.tokens) - self.n_cached

    @property
    def is_prefilling(self) -> bool:
        return self.to_feed > 1 or self.n_generated == 0

    @property
    def remaining_tokens(self) -> int:
        """How many more tokens this lane may generate."""
        return self.request.max_tokens - self.n_generated

    @property
    def pinned(self) -> bool:
        """Never preempted: it must tick alone, or it holds media."""
        return self.request.batch_invariant or bool(self.request.media)

    @property
    def active(self) -> bool:
        return self.state in (LaneState.PREFILLING, LaneState.DECODING)

    @property
    def seniority(self) -> tuple[float, float]:
        """When it was first admitted, then when it arrived: lanes admitted in one scheduling pass
        share ``admitted_at``, and their arrival orders them (a requeued lane keeps both)."""
        return (self.admitted_at or 0.0, self.queued_at)

    @property
    def embedded(self) -> bool:
        """An embedding lane whose whole prompt is computed: its embedding is ready."""
        return self.request.embed and self.n_cached >= self.n_prompt

    # ---- what happens to it ------------------------------------------------------------------

    def request_cancel(self) -> None:
        """A client cancelled it while it runs: the scheduler ends it once the tick in flight is
        done."""
        self.cancel_requested = True

    def tick_passed(self, served: bool, passed_over: bool = True) -> None:
        """Another tick went by: one more it waited for, unless it was served (queued lanes never
        are). Starvation is counted in these. A running lane that was not ``passed_over`` (only
        lanes of its class or above admitted no later were served) waited its turn: the count stays."""
        if served:
            self.waited_ticks = 0
        elif passed_over:
            self.waited_ticks += 1

    def group_wait(self, ticks: int) -> None:
        """Ticks since a lane of its LoRA adapter set last ran (``core/adapter_groups.py``)."""
        self.group_waited = ticks

    def bind(self, binding: Binding, now: float) -> bool:
        """Admitted (again, after a preemption) into ``binding.slot``, seeded as the KV manager
        decided; a parked KV is its seed now. True on its first admission."""
        self.slot, self.seed, self.n_cached = binding.slot, binding.seed, binding.n_cached
        self.n_reused += binding.reused
        self.parked, self.parked_tokens = None, 0
        self.state, self.needs_reset, self.waited_ticks = LaneState.PREFILLING, True, 0
        if self.admitted_at is not None:
            return False
        self.admitted_at = now
        return True

    def reset_done(self) -> None:
        """A tick set its slot up from its seed: later ticks append to that KV."""
        self.needs_reset, self.seed = False, OWN

    def note_fed(self, n_fed: int, n_prefilled: int) -> None:
        """A tick appended ``n_fed`` of its tokens to its KV, ``n_prefilled`` of them computed
        prompt tokens."""
        self.n_cached += n_fed
        self.n_prefilled += n_prefilled

    def note_first_token(self, now: float) -> None:
        self.first_token_at = now

    def refresh_state(self) -> None:
        """Prefilling while more than its last sampled token is left to feed, else decoding."""
        self.state = LaneState.PREFILLING if self.is_prefilling else LaneState.DECODING

    def lose_kv(self, not_reused: int = 0) -> None:
        """Its slot will not hold the KV it counted on (the engine could not give its seed, the
        seed's source was freed first, or the engine restarted empty): it feeds its tokens again
        from the start. ``not_reused``: prefix-cache tokens counted for it that it did not get."""
        self.n_reused = max(0, self.n_reused - not_reused)
        self.n_cached, self.needs_reset, self.seed = 0, True, OWN

    def preempt(self, release: Release) -> None:
        """Preempted: out of its slot and queued again, its KV parked or dropped as the KV
        manager decided. It resumes from its parked KV, else from its tokens."""
        self.n_reused = max(0, self.n_reused - release.not_reused)
        self.parked, self.parked_tokens = release.parked, release.parked_tokens
        self.slot, self.n_cached, self.seed = None, 0, OWN
        self.state, self.waited_ticks = LaneState.PREEMPTED, 0
        self.preemptions += 1

    def unpark(self) -> None:
        """Its parked KV is gone (parking failed, or the engine lost it): it prefills again."""
        self.parked, self.parked_tokens = None, 0

    def end(self, state: LaneState, reason: str, now: float) -> None:
        """Finished, cancelled or failed: out of its slot, its parked KV dropped."""
        self.state, self.finish_reason, self.finished_at = state, reason, now
        self.slot, self.parked = None, None

    def take(self, tokens: list[int], eog: bool, context_length: int) -> tuple[str, tuple[int, ...], str | None]:
        """Append a tick's sampled tokens and release their text. Returns the text, the tokens
        that count toward usage (an ending end-of-generation token does not), and the finish
        reason if the generation ended: "stop" (end of generation or a stop string), "length"
        (max_tokens or the context is full). Text is released only whole characters at a time
        (:class:`~superfluid.core.textstream.TextStream`)."""
        text, used = [], []
        reason = None
        last = len(tokens) - 1
        for i, token in enumerate(tokens):
            self.tokens.append(token)
            if eog and i == last and not self.request.ignore_eos:
                reason = "stop"
                break
            self.n_output += 1
            used.append(token)
            text.append(self.text.push(token))
            if self.text.stopped:
                reason = "stop"
                break
            if self.remaining_tokens <= 0 or len(self.tokens) >= context_length:
                reason = "length"
                break
        return "".join(text), tuple(used), reason


@attrs.define(frozen=True)
class LaneEvent:
    """Sent to a request's sink. ``kind`` is "admitted", "scored" (a scored prompt's logprobs are
    all known: sent once, before the lane's first "delta"), "delta", "paused" (preempted),
    "resumed", "finished" or "error".

    "delta" carries released text and the tokens it came from; "finished" carries the finish
    reason ("stop", "length", "cancelled"), the usage counts and, for a scored prompt or an
    embedding, their results; "error" carries the exception. ``timings``: "admitted" has the
    seconds it queued (``queued_s``); "finished" and "error" the lane's timestamps (monotonic
    seconds: ``queued_at``, ``admitted_at``, ``first_token_at``, ``finished_at``, ``arrived``)
    and ``prefilled``, the prompt tokens it computed (see :func:`~superfluid.core.stats.timings`)."""

    kind: str
    request_id: str
    text: str = ""
    token_ids: tuple[int, ...] = ()
    logprobs: tuple = ()          # "delta": a TokenLogprob per token of ``token_ids`` (if asked for)
    prompt_logprobs: tuple = ()   # "scored", "finished": a scored prompt's TokenLogprob per position from 1 on
    embedding: tuple = ()         # "finished", an embedding lane: its pooled, L2-normalised embedding
    finish_reason: str | None = None
    stop_string: str | None = None  # "finished" with "stop": the stop string that ended it (None: end of generation)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    error: BaseException | None = None
    timings: dict = attrs.field(factory=dict)
