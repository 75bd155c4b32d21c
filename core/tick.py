"""One engine call: what the scheduler asks of the engine, and what comes back."""

from __future__ import annotations

import attrs

from .media import MediaSpan
from .request import AdapterSet, SamplingParams


@attrs.define(frozen=True)
class Seed:
    """Where a reset slot's KV comes from before the lane's feed is appended to it.

    The engine sets the slot up from the source and keeps only its first ``LanePlan.pos``
    tokens; a source that cannot hold them is a ``LaneResult.restore_failed``.

    * ``Seed()`` — the slot's own KV (cut to ``pos``; ``pos`` 0 clears it);
    * ``Seed(slot=s)`` — a copy of slot ``s``'s KV (a running lane or a cached prefix);
    * ``Seed(key=k)`` — parked KV under key ``k``, taken out of host memory (a preempted
      lane's own KV);
    * ``Seed(key=k, shared=True)`` — parked KV that stays parked for other lanes (a prefix in
      the host tier)."""

    slot: int | None = None
    key: str | None = None
    shared: bool = False

    @property
    def own(self) -> bool:
        return self.slot is None and self.key is None


OWN = Seed()


@attrs.define(frozen=True)
class TokenLogprob:
    """One position's log-probabilities, from the model's distribution before any bias,
    constraint, penalty or filter: the token's own and, best first, the ``top`` candidates as
    (token, logprob) pairs."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@attrs.define
class LanePlan:
    """One lane's share of a tick.

    The engine appends ``feed`` to the slot's KV at positions ``pos, pos+1, …``. If ``sample`` is
    set the feed reaches the end of the lane's tokens: the engine samples after it and then runs up
    to ``max_new - 1`` more decode rounds, feeding back each sampled token, stopping early at an
    end-of-generation token unless ``ignore_eos``. ``reset`` starts a fresh sampler from
    ``sampling`` and first sets up the slot's KV from ``seed``; in every case only its first
    ``pos`` tokens are kept (``pos`` 0: the slot is cleared)."""

    slot: int
    pos: int
    feed: list[int]
    sample: bool
    max_new: int = 0
    reset: bool = False
    sampling: SamplingParams | None = None
    ignore_eos: bool = False
    decode: bool = False  # the feed is the lane's own last sampled token (already seen by its sampler)
    seed: Seed = OWN  # with ``reset``: where the slot's first ``pos`` tokens of KV come from
    replay_from: int | None = None  # from this position on, feed one token per step, as decoding did
    history: list[int] | None = None  # tokens already in the KV, for a fresh penalty or grammar sampler
                                      # (a grammar takes those from ``replay_from`` on: the generated ones)
    # Score the prompt: ``targets[i]`` is the prompt token that follows ``feed[i]``; the engine
    # returns its logprob given everything up to ``feed[i]`` (``LaneResult.prompt_logprobs``, with
    # ``score_top`` candidates). One shorter than the feed where the feed ends the prompt.
    targets: list[int] | None = None
    score_top: int = 0
    # An embedding lane: the engine adds up the final hidden state of every fed token into
    # ``LaneResult.embedding_sum`` (and ``pooled``: how many), and samples nothing.
    embed: bool = False
    # With ``embed``: a reranker's lane (Request.rank). The engine pools the rows the model's rank
    # pooling takes (the last token of a causal model) and returns the classification head's
    # outputs on them in ``embedding_sum``, with ``pooled`` 1.
    rank: bool = False
    # The images whose rows the feed holds: a negative feed token is a placeholder
    # (core/media.py), and the engine feeds the embedding row of the span that covers its position
    # there instead of a token embedding. Empty for a feed of tokens only.
    media: tuple[MediaSpan, ...] = ()
    # ``(start, nx, ny)`` of every image in the lane's tokens whose rows sit on a 2-D grid
    # (M-RoPE: Qwen-VL): past one, a token's model position is not its index, so an engine
    # needs them to place the feed, cut, copy or restore the slot, decode grants included.
    grids: tuple[tuple[int, int, int], ...] = ()
    # The LoRA adapters this lane runs under (its request's set; () the base model). On an engine
    # whose ``EngineCapabilities.adapters`` is "per_tick", every lane of one plan has the same set.
    adapters: AdapterSet = ()


@attrs.define
class TickPlan:
    """For one engine call: per lane a prefill chunk or a decode grant, plus slots to release.

    The engine applies, in order: ``park`` (copy each slot's KV to host memory under a key),
    ``load`` (read a park artifact file into host memory under a key), ``save`` (write parked KV
    to a park artifact file), ``drop_parked`` (forget parked KV), ``release`` (clear slots), then
    the lanes. ``load`` and ``save`` need ``EngineCapabilities.persists_kv``."""

    lanes: list[LanePlan] = attrs.field(factory=list)
    release: list[int] = attrs.field(factory=list)
    park: list[tuple[int, str]] = attrs.field(factory=list)
    load: list[tuple[str, str]] = attrs.field(factory=list)   # (file path, park key)
    save: list[tuple[str, str]] = attrs.field(factory=list)   # (park key, file path)
    drop_parked: list[str] = attrs.field(factory=list)
    prefill_budget: int = 0   # the budget this plan was cut from (for metrics)
    decode_grant: int = 0     # decode rounds granted per decoding lane (for metrics)
    target_s: float = 0.0     # the duration the planner sized this tick toward
    end_after_first_token: bool = False  # end the tick at the step that samples a lane's first token
    step_tokens: int = 0      # most tokens per engine step (0: the engine's own); bounds how late a stop lands
    # No one waits on this tick's tokens before it ends (no queue, no prefill, no streamed reply, no
    # stop strings), so it may run past the free-lane target. It yields instead: a request queued
    # meanwhile ends it after the engine's step in flight, and so does a lane that stops (its
    # generation ended, or its grant, which in a quiet tick is short only for a finishing lane).
    quiet: bool = False
    # Park artifacts are being written off the tick thread: a plan with nothing else to do still
    # goes to the engine, to collect the writes that finished (TickResult.saved).
    collect_saves: bool = False
    # LoRA adapters to load (name, file path) and to unload (name), applied before anything else in
    # the plan; an adapter is unloaded only once no lane runs under it. A load that fails is
    # reported in ``TickResult.adapter_errors`` and leaves the adapter unknown to the engine.
    load_adapters: list[tuple[str, str]] = attrs.field(factory=list)
    unload_adapters: list[str] = attrs.field(factory=list)

    @property
    def prefill_tokens(self) -> int:
        return sum(len(lp.feed) for lp in self.lanes if not lp.decode)

    def empty(self) -> bool:
        return not (self.lanes or self.release or self.park or self.load or self.save or self.drop_parked
                    or self.collect_saves or self.load_adapters or self.unload_adapters)


@attrs.define
class LaneResult:
    slot: int
    n_fed: int = 0                              # tokens appended to the KV this tick
    n_prefill: int = 0                          # of those, prompt (not decode) tokens
    tokens: list[int] = attrs.field(factory=list)  # tokens sampled this tick, in order
    eog: bool = False                           # the last sampled token ends the generation
    restore_failed: bool = False                # the seed (parked, restored or copied KV) was not there or
                                                # not usable: the slot was cleared, nothing was fed
    logprobs: list[TokenLogprob] = attrs.field(factory=list)  # per sampled token, if its sampling asks
    prompt_logprobs: list[TokenLogprob] = attrs.field(factory=list)  # per target of the plan, in order
    embedding_sum: list[float] | None = None    # an embedding lane: the sum of its fed tokens' hidden states
    pooled: int = 0                             # how many tokens that sum holds
    error: str | None = None                    # this lane's request failed in the engine (an image that could
                                                # not be encoded): the scheduler fails it alone


@attrs.define
class StepTiming:
    """One engine step (one batched forward pass): how many prefill and decode tokens it held."""

    prefill_tokens: int
    decode_tokens: int
    seconds: float
    drafted: int = 0    # speculative decoding: tokens drafted for decoding lanes to verify in this step
    accepted: int = 0   # of those, the ones the model agreed with


@attrs.define
class TickResult:
    lanes: dict[int, LaneResult] = attrs.field(factory=dict)
    parked: dict[str, int] = attrs.field(factory=dict)  # park key -> bytes held (0: parking failed)
    saved: dict[str, int] = attrs.field(factory=dict)   # file path -> bytes written (0: failed); a write
    # is reported by the tick in which it finished, which may come after the one that asked for it
    saves_pending: int = 0  # writes asked for and not finished yet (the loop keeps ticking for them)
    parked_bytes: int = 0  # all parked KV the engine holds in host memory
    steps: list[StepTiming] = attrs.field(factory=list)
    stopped_early: bool = False
    seconds: float = 0.0
    kv_used: int = 0
    encoded: int = 0       # images the engine's vision encoder ran on in this tick (not served from its cache)
    kv_capacity: int = 0
    # The KV pool could not hold the plan's next step (a pool shared by all lanes, smaller than
    # lanes × context): this many tokens were refused. The tick ended there, as when stopped early:
    # each lane reports what it fed, the rest is left undone, and nothing of the refused step was
    # kept. The scheduler frees room (cached prefixes, then lanes) and plans the rest again.
    rejected_tokens: int = 0
    adapter_errors: dict[str, str] = attrs.field(factory=dict)  # adapter name -> why its load failed
