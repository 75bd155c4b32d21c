"""Tick planning: how much prefill and how many decode rounds go into the next engine call.

Sized from the measured cost model toward the spec's targets: short ticks while a lane is free
or finishing (admission stays fast), longer ones while every lane is busy. A quiet tick (see
:func:`is_quiet`) runs to the busy target even with a lane free, since it yields to a newcomer at
the engine's next step instead of making it wait for the tick."""

from __future__ import annotations

import math

from superfluid.core import qos
from superfluid.core.lane import Lane
from superfluid.core.media import whole_chunk
from superfluid.core.tick import OWN, LanePlan, TickPlan

from .groups import adapter_group
from .options import OPTIONS

STEP_TARGET_S = 0.5             # one engine step's work, so an early stop lands within this
MIN_STEP = 128                  # (engines that cannot abort a step in flight) ...
STEP_CEILING_S = 2.0            # ... unless that many tokens take longer than this
PROBE_STEP = 32                 # (such an engine's steps until a prefill has been measured)
PREFILL_CAP_ADMITTING_S = 0.5   # while a newcomer could be admitted at the end of the tick
PREFILL_CAP_BUSY_S = 8.0
CHUNK = 512                     # whole chunks of this size ...
SMALL_STEP = 128                # ... or steps of this size on a model too slow for one chunk
ADAPTIVE_MIN, ADAPTIVE_MAX = 256, 4096
URGENT = qos.URGENT


def tick_target_s(capabilities, settings, admitting: bool) -> float:
    if admitting:
        return capabilities.tick_target_free_ms / 1000.0
    return min(settings.tick_target_ms, capabilities.tick_target_busy_cap_ms) / 1000.0


def prefill_budget(costs, capabilities, settings, admitting: bool) -> int:
    """Tokens of prefill this tick may hold: the configured (or adaptive) budget, capped by time."""
    per_token = max(costs.prefill_per_token(), 1e-7)
    if settings.prefill_budget:
        budget = settings.prefill_budget
    else:  # adaptive: a prefill tick lands near the busy tick target
        target = tick_target_s(capabilities, settings, admitting=False)
        budget = int(min(max(target / per_token, ADAPTIVE_MIN), ADAPTIVE_MAX))
    cap_s = PREFILL_CAP_ADMITTING_S if admitting else PREFILL_CAP_BUSY_S
    cap_tokens = cap_s / per_token
    if cap_tokens >= CHUNK:
        cap_tokens = (int(cap_tokens) // CHUNK) * CHUNK
    else:
        cap_tokens = max(SMALL_STEP, (int(cap_tokens) // SMALL_STEP) * SMALL_STEP)
    return max(1, min(budget, int(cap_tokens)))


def step_tokens(costs, capabilities) -> int:
    """Tokens per engine step: the engine's micro-batch, smaller on a model so slow (or a context so
    long) that one would take more than STEP_TARGET_S, so a stop request never waits long.

    Smaller steps cost an accelerator its batching, so a step keeps MIN_STEP tokens at least,
    but never more than STEP_CEILING_S holds: MLX's CPU kernels take 0.1 s a prompt token, and a
    128-token step there (13 s) held a dropped request's lane, or a chat's preemption, that long.
    Such kernels gain little from batching (their decode is barely slower a token).

    Until a prefill step has been measured the rate is a guess, so such an engine's first steps
    are PROBE_STEP tokens: on MLX's CPU kernels a step sized from the guess took 12.5 s."""
    full = max(capabilities.prefill_step_tokens, 1)
    if capabilities.aborts_mid_step:
        return full
    if not getattr(costs, "prefill_measured", True):
        return min(full, PROBE_STEP)
    per_token = max(costs.prefill_per_token(), 1e-7)
    fit = int(STEP_TARGET_S / per_token)
    if fit >= full:
        return full
    floor = max(1, min(MIN_STEP, int(STEP_CEILING_S / per_token)))
    return max(floor, (fit // 32) * 32)


def stream_step(costs, capabilities, settings, budget: int, step: int) -> int:
    """Prefill tokens a tick may hold while a client reads a stream: what the busy tick target
    prefills, in one engine step (at least one token). A stream sees nothing between two tick
    ends, so a 512-token step (about 2 s of SmolLM2 on 2 CPU cores) or a step of STEP_CEILING_S
    (20 tokens of MLX's CPU kernels, 0.1 s a prompt token) would be that long a gap in every stream while a
    newcomer prefills; held to the target, each gap is one target's prefill and one decode round.
    The newcomer's prompt then takes more, smaller steps: its first token comes later, the streams
    flow."""
    per_token = max(costs.prefill_per_token(), 1e-7)
    fit = int(tick_target_s(capabilities, settings, admitting=False) / per_token)
    return max(1, min(budget, step, fit))


def finishing_rounds(decoding: list[Lane], busy_rounds: int) -> int:
    """Decode rounds that end every streamed lane whose last tokens fit in one busy tick
    (``busy_rounds``, the rounds the busy target holds); 0 if no streamed lane is that near its end.

    While a client reads a stream, a newcomer's prefill is held to what the busy target holds
    (:func:`stream_step`), and small steps prefill slower: on a 2-core AMD EPYC, SmolLM2 took a
    long prompt at 157-168 tokens a second in 48-token steps against 216 in 128-token steps
    and 235-248 in 256-token ones. An agent's 16-token reply kept the next agent's prompt in
    such steps for 15 ticks. A tick of the finishing lanes' last rounds alone (15 rounds of
    SmolLM2: 0.17 s) ends their streams at once and gives the prefill its full steps back."""
    return max((l.remaining_tokens for l in decoding if l.request.streamed and l.remaining_tokens <= busy_rounds),
               default=0)


def is_quiet(decoding: list[Lane], prefilling: list[Lane], queue: list[Lane], capabilities) -> bool:
    """Whether no one needs this tick to end soon: nothing queued or prefilling, and every decoding
    lane's reply is sent whole with no stop strings to look for, so its client reads nothing
    before the lane's last token. Short ticks would then buy nothing but tick overhead (at one
    SmolLM2 lane, 2 % of the decode rate). It takes an engine that can end a tick between steps:
    a request queued meanwhile, or a lane's end of generation, ends the tick there."""
    return bool(decoding and not prefilling and not queue and capabilities.stops_mid_tick
                and capabilities.uniform_decode_rounds
                and not any(l.request.streamed or l.request.stop for l in decoding))


def prefill_order(lanes: list[Lane], settings) -> list[Lane]:
    """Urgent lanes first, then starving lanes, then by class, then shortest remaining prompt
    first, the oldest first among equals.

    Shortest remaining first makes equal-class agents prefill in turn: the lane that has started
    has the least left, so it keeps the budget until its first token, and the others' first tokens
    come as they would one at a time, instead of all late together. A lane starves
    (``waited_ticks`` reaches ``starvation_ticks``) only when lanes admitted after it, or of a
    higher class, took the prefill it waited for (the scheduler counts it so, see
    ``Lane.tick_passed``); waiting behind a lane of its own class admitted no later (in the same
    pass, too) is its turn, not starvation. A starving lane then gets the next
    chunk, which bounds how long a long prompt waits behind a stream of short ones.

    The spec orders "starving lanes first, then by class"; interactive and completion lanes
    (the urgent classes) still go before starving lanes, because an agent that starved behind
    other agents would otherwise take a chat's first prefill chunk, which is the one thing the
    interactive class promises (first token within a second)."""
    def key(lane: Lane):
        starving = lane.waited_ticks >= max(settings.starvation_ticks, 1)
        return (lane.qos not in URGENT, not starving, qos.priority(lane.qos), lane.to_feed,
                lane.seniority)
    return sorted(lanes, key=key)


def plan_tick(lanes: list[Lane], queue: list[Lane], costs, capabilities, settings) -> TickPlan:
    bound = len(lanes)  # lanes holding a slot, whatever this tick runs
    if getattr(capabilities, "adapters", "none") == "per_tick":  # one LoRA adapter set per step
        lanes = adapter_group(lanes, settings)
    grouped = len(lanes) < bound  # other adapter groups wait for their turn
    solo = [l for l in lanes if l.request.batch_invariant]
    if solo:  # a batch-invariant lane ticks alone, so its output does not depend on other traffic
        lanes = [min(solo, key=lambda l: l.admitted_at or 0.0)]
    decoding = [l for l in lanes if not l.is_prefilling]
    prefilling = [l for l in lanes if l.is_prefilling]
    base_rounds = max(1, round(tick_target_s(capabilities, settings, False)
                             / max(costs.decode_round(max(len(decoding), 1)), 1e-6)))
    finishing = any(l.remaining_tokens <= base_rounds for l in decoding)
    admitting = bound < settings.max_batch or finishing
    # a long quiet tick would hold the other adapter groups' lanes: none while groups take turns
    quiet = (OPTIONS.of(settings).quiet_ticks and not grouped
             and is_quiet(decoding, prefilling, queue, capabilities))
    target = tick_target_s(capabilities, settings, admitting and not quiet)

    plan = TickPlan(target_s=target, step_tokens=step_tokens(costs, capabilities), quiet=quiet)
    # a client reads tokens as each tick ends, on an engine where cutting ticks short costs nothing
    streams = capabilities.uniform_decode_rounds and any(l.request.streamed for l in decoding)
    budget = prefill_budget(costs, capabilities, settings, admitting)
    if decoding and capabilities.uniform_decode_rounds:
        # Tokens reach clients only when a tick ends. Where cutting ticks short costs nothing
        # (llama.cpp, MLX), keep them near the target while lanes decode: one step at least.
        streaming = max(plan.step_tokens, int(target / max(costs.prefill_per_token(), 1e-7)))
        budget = min(budget, streaming)
        if streams:
            budget = plan.step_tokens = stream_step(costs, capabilities, settings, budget, plan.step_tokens)
    plan.prefill_budget = budget
    left = budget
    chunks: list[tuple[Lane, int]] = []
    for lane in prefill_order(prefilling, settings):
        if left <= 0:
            break
        n = min(lane.to_feed, left)
        if lane.request.media:  # an image goes whole, past the budget if need be
            n = whole_chunk(lane.request.media, lane.n_cached, n)
        chunks.append((lane, n))
        left -= n
    # A tick in which an urgent prompt finishes prefills nothing of a lower class beside it.
    urgent_done = [qos.priority(l.qos) for l, n in chunks if n == l.to_feed and l.qos in URGENT]
    if urgent_done:
        floor = max(urgent_done)
        chunks = [(l, n) for l, n in chunks if qos.priority(l.qos) <= floor]
    # Streams about to end take a tick of their last rounds before the prefill goes on in full
    # steps, when the prompts held would still be prefilling in small steps as the streams end
    # anyway (an agent's long prompt). A prompt the small steps finish first keeps its place (a
    # second chat's short one: its first token would wait for the whole reply), and an urgent
    # prompt's prefill never waits.
    finish = finishing_rounds(decoding, base_rounds) if streams and chunks else 0
    held = sum(l.to_feed for l, _ in chunks)
    if finish and held > finish * budget and not any(l.qos in URGENT for l, _ in chunks):
        chunks = []
    else:
        finish = 0

    prefill_total = sum(n for _, n in chunks)
    steps = math.ceil(prefill_total / plan.step_tokens) if prefill_total else 0
    replays = [max(0, l.n_cached + n - max(l.n_cached, l.n_prompt)) for l, n in chunks if l.n_generated]
    steps += max(replays, default=0)  # replayed tokens take a step each
    # Rounds that fill the target most nearly (truncating would halve a tick whose round costs
    # a little over half the target, doubling the ticks and their overhead).
    decode_round = max(costs.decode_round(max(len(decoding), 1)), 1e-6)
    rounds = max(1, round(target / decode_round))
    if streams and prefill_total:
        # the prefill already fills the tick: rounds on top of it would lengthen every stream's gap
        rounds = max(1, round((target - prefill_total * costs.prefill_per_token()) / decode_round))
    if finish:
        rounds = finish
    first_due = any(n == l.to_feed and l.first_token_at is None for l, n in chunks)
    if first_due:
        # A first token is due: the tick ends right after it so it reaches the client now.
        rounds = 1
        plan.end_after_first_token = True
    samplers = len(decoding) + sum(n == l.to_feed for l, n in chunks)
    if settings.tick_decode_budget and samplers:
        rounds = max(1, min(rounds, settings.tick_decode_budget // samplers))

    ctx = settings.context_length
    for lane, n in chunks:
        sample = n == lane.to_feed
        grant = min(rounds, lane.remaining_tokens, ctx - len(lane.tokens)) if sample else 0
        plan.lanes.append(_lane_plan(lane, n, sample, max(grant, 1) if sample else 0, decode=False))
    # Decoding lanes get a token in every step the tick takes (prefill steps included).
    decode_rounds = rounds if settings.tick_decode_budget else max(rounds, steps)
    plan.decode_grant = decode_rounds
    for lane in decoding:
        grant = max(1, min(decode_rounds, lane.remaining_tokens, ctx - len(lane.tokens)))
        plan.lanes.append(_lane_plan(lane, 1, True, grant, decode=True))
    return plan


def _lane_plan(lane: Lane, n: int, sample: bool, max_new: int, decode: bool) -> LanePlan:
    req = lane.request
    reset = lane.needs_reset
    catch_up = req.sampling.uses_penalties or req.sampling.constrained  # a fresh sampler replays these
    history = lane.tokens[:lane.n_cached] if reset and lane.n_cached and catch_up else None
    return LanePlan(slot=lane.slot, pos=lane.n_cached, feed=lane.tokens[lane.n_cached:lane.n_cached + n],
                    sample=sample, max_new=max_new, reset=reset,
                    sampling=req.sampling if reset else None, ignore_eos=req.ignore_eos,
                    decode=decode and not reset, adapters=req.adapters,
                    seed=lane.seed if reset else OWN, history=history,
                    # A lane resuming its generation (KV dropped) replays its generated tokens one
                    # per step, as decoding computed them, so its KV and text come out the same.
                    replay_from=lane.n_prompt if lane.n_generated > 0 else None)
