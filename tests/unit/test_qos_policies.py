"""The default QoS policies (plugins/qos) called directly, on hand-built lanes.

No model thread and no engine: each test builds Lane objects from Requests, puts them in the
state it needs (slot, n_cached, generated tokens, waited ticks, admission time) and calls one
policy function: class vocabulary (core/qos.py), admission order and preemption victims
(admission.py), tick planning (planner.py) with a real CostModel fed StepTimings, and the
``--class-lanes`` option (options.py). Scheduler-level behaviour is in test_scheduler.py.
"""

from __future__ import annotations

import itertools
import math

import attrs
import pytest

from superfluid.core import qos
from superfluid.core.config import Config, ModelConfig
from superfluid.core.costs import CostModel
from superfluid.core.engine import EngineCapabilities
from superfluid.core.errors import ConfigError, InvalidRequest
from superfluid.core.lane import Lane, LaneState
from superfluid.core.request import Request
from superfluid.core.settings import SchedulerSettings
from superfluid.core.textstream import TextStream
from superfluid.core.tick import StepTiming
from superfluid.plugins.qos import admission, options, planner

CAPS = EngineCapabilities(max_lanes=8, context_length=4096)
CTX = 4096
BUSY_TARGET_S = min(2000, CAPS.tick_target_busy_cap_ms) / 1000.0   # 0.25 s
_clock = itertools.count(1)
_tok = itertools.count(1)


# ---- building lanes -------------------------------------------------------------------------------

def queued(cls: str = "agent", prompt: int = 10, *, waited: int = 0, invariant: bool = False,
           media: bool = False, max_tokens: int = 100) -> Lane:
    """A lane still in the queue."""
    req = Request(prompt_tokens=[next(_tok) % 1000 for _ in range(prompt)], max_tokens=max_tokens,
                  sink=lambda e: None, qos=cls, batch_invariant=invariant, media=media)
    lane = Lane(request=req, text=TextStream(lambda t: b"x"))
    lane.waited_ticks = waited
    return lane


def prefilling(cls: str = "agent", prompt: int = 100, *, cached: int = 0, generated: int = 0,
               max_tokens: int = 100, waited: int = 0, first_token: bool = False,
               invariant: bool = False, media: bool = False, admitted_at: float | None = None) -> Lane:
    """A running lane with ``prompt + generated - cached`` tokens still to feed.

    ``generated`` > 0 with ``cached`` 0 is a lane resumed after preemption (its KV dropped)."""
    lane = queued(cls, prompt, invariant=invariant, media=media, max_tokens=max_tokens)
    lane.tokens.extend(7 for _ in range(generated))
    lane.n_cached = cached
    lane.state = LaneState.PREFILLING
    lane.slot = next(_clock)
    lane.admitted_at = float(next(_clock)) if admitted_at is None else admitted_at
    lane.waited_ticks = waited
    lane.needs_reset = cached == 0
    if first_token or generated:
        lane.first_token_at = lane.admitted_at + 0.5
    assert lane.is_prefilling
    return lane


def decoding(cls: str = "agent", prompt: int = 20, *, generated: int = 5, max_tokens: int = 1000,
             invariant: bool = False, media: bool = False, admitted_at: float | None = None) -> Lane:
    """A running lane whose KV holds everything but the last sampled token."""
    lane = queued(cls, prompt, invariant=invariant, media=media, max_tokens=max_tokens)
    lane.tokens.extend(7 for _ in range(generated))
    lane.n_cached = len(lane.tokens) - 1
    lane.state = LaneState.DECODING
    lane.slot = next(_clock)
    lane.admitted_at = float(next(_clock)) if admitted_at is None else admitted_at
    lane.first_token_at = lane.admitted_at + 0.5
    lane.needs_reset = False
    assert not lane.is_prefilling and lane.to_feed == 1
    return lane


def settings(**kw) -> SchedulerSettings:
    kw.setdefault("max_batch", 8)
    kw.setdefault("context_length", CTX)
    return SchedulerSettings(**kw)


def measured(prefill: float | None = None, decode: dict[int, float] | None = None,
             costs: CostModel | None = None, n: int = 100) -> CostModel:
    """A real CostModel that has observed ``n`` prefill steps at ``prefill`` s/token and one
    decode round per batch size in ``decode`` (the first decode observation is taken as is)."""
    cm = costs or CostModel()
    if prefill is not None:
        for _ in range(n):
            cm.observe([StepTiming(prefill_tokens=512, decode_tokens=0, seconds=512 * prefill)])
        assert cm.prefill_per_token() == pytest.approx(prefill, rel=1e-9)
    for lanes, seconds in (decode or {}).items():
        cm.observe([StepTiming(prefill_tokens=0, decode_tokens=lanes, seconds=seconds)])
    return cm


def plan(lanes, costs, queue=(), caps=CAPS, **kw):
    return planner.plan_tick(list(lanes), list(queue), costs, caps, settings(**kw))


# An engine whose tick length matters (a native engine): the 8 s and 0.5 s caps apply as they are.
NATIVE = EngineCapabilities(max_lanes=8, context_length=4096, uniform_decode_rounds=False)


def grants(p, lanes) -> dict[Lane, object]:
    """The plan's LanePlan per lane (by slot)."""
    by_slot = {lp.slot: lp for lp in p.lanes}
    assert len(by_slot) == len(p.lanes), "a slot planned twice"
    return {lane: by_slot[lane.slot] for lane in lanes if lane.slot in by_slot}


def fed(p, lanes) -> list[tuple[Lane, int]]:
    """Prefill chunks in plan order: (lane, tokens fed)."""
    by_slot = {lane.slot: lane for lane in lanes}
    return [(by_slot[lp.slot], len(lp.feed)) for lp in p.lanes if not lp.decode]


# ---- the class vocabulary ---------------------------------------------------------------------------

def test_class_order_and_default():
    assert qos.CLASSES == ("interactive", "completion", "agent", "background")
    assert [qos.priority(c) for c in qos.CLASSES] == [0, 1, 2, 3]
    assert qos.DEFAULT_CLASS == "agent"
    assert Request(prompt_tokens=[1], max_tokens=1, sink=lambda e: None).qos == "agent"
    assert set(qos.URGENT) == {"interactive", "completion"}


@pytest.mark.parametrize("name, canonical", [
    ("interactive", "interactive"), ("interactive-chat", "interactive"), ("0", "interactive"),
    ("completion", "completion"), ("inline-completion", "completion"), ("1", "completion"),
    ("agent", "agent"), ("foreground", "agent"), ("foreground-agent", "agent"), ("2", "agent"),
    ("background", "background"), ("background-agent", "background"), ("3", "background"),
    ("Interactive-Chat", "interactive"), ("  BACKGROUND ", "background"),
])
def test_resolve_maps_every_alias(name, canonical):
    assert qos.resolve(name) == canonical


def test_every_alias_is_in_the_spec_table():
    assert set(qos.ALIASES) == {
        "interactive", "interactive-chat", "0", "completion", "inline-completion", "1",
        "agent", "foreground", "foreground-agent", "2", "background", "background-agent", "3"}


@pytest.mark.parametrize("name", ["urgent", "", "4", "-1", "interactive chat", "batch"])
def test_resolve_unknown_raises_invalid_request_listing_names(name):
    with pytest.raises(InvalidRequest) as info:
        qos.resolve(name, param="qos")
    err = info.value
    assert err.status == 400
    assert err.code == "invalid_qos_class"
    assert err.param == "qos"
    assert repr(name) in err.message
    listed = err.message.split("valid names: ", 1)[1].split(", ")
    assert sorted(listed) == sorted(qos.ALIASES)
    # listed in class order: every interactive name before any completion name, and so on
    assert [qos.priority(qos.ALIASES[a]) for a in listed] == sorted(
        qos.priority(qos.ALIASES[a]) for a in listed)


def test_resolve_default_param_is_the_header():
    with pytest.raises(InvalidRequest) as info:
        qos.resolve("nope")
    assert info.value.param == "x-superfluid-qos"


# ---- pick_next ----------------------------------------------------------------------------------------

def pick(queue, lanes=(), **kw):
    kw.setdefault("starvation_ticks", 8)
    return admission.pick_next(list(queue), list(lanes), settings(**kw))


def test_pick_next_empty_queue():
    assert pick([]) is None


@pytest.mark.parametrize("order", list(itertools.permutations(qos.CLASSES)))
def test_pick_next_takes_the_most_urgent_class(order):
    queue = [queued(cls) for cls in order]
    assert pick(queue).qos == "interactive"
    assert pick([l for l in queue if l.qos != "interactive"]).qos == "completion"
    assert pick([l for l in queue if l.qos in ("agent", "background")]).qos == "agent"


def test_pick_next_fifo_within_a_class():
    a1, b1, a2, a3 = queued("agent"), queued("background"), queued("agent"), queued("agent")
    queue = [b1, a1, a2, a3]
    picked = []
    while queue:
        lane = pick(queue)
        picked.append(lane)
        queue.remove(lane)
    assert picked == [a1, a2, a3, b1]


@pytest.mark.parametrize("waited, expected", [
    (0, 3), (7, 3), (8, 2), (15, 2), (16, 1), (23, 1), (24, 0), (32, 0), (10_000, 0)])
def test_effective_priority_rises_one_class_per_period(waited, expected):
    assert admission.effective_priority(queued("background", waited=waited), 8) == expected


def test_effective_priority_never_below_interactive():
    assert admission.effective_priority(queued("interactive", waited=100), 8) == 0
    assert admission.effective_priority(queued("agent", waited=3), 1) == 0
    assert admission.effective_priority(queued("agent", waited=3), 0) == 0  # period 0 acts as 1


def test_aged_background_is_picked_over_a_fresh_agent_once_above_it():
    fresh = queued("agent")
    # risen two classes (to completion's level): ahead of the agent though queued behind it
    old = queued("background", waited=16)
    assert pick([fresh, old]) is old
    # risen one class only (agent's level): a tie, so queue order decides
    level = queued("background", waited=8)
    assert pick([fresh, level]) is fresh
    assert pick([level, fresh]) is level
    # not yet risen
    assert pick([queued("background", waited=7), fresh]) is fresh


def test_aging_follows_the_configured_period():
    fresh = queued("agent")
    old = queued("background", waited=6)
    assert pick([fresh, old], starvation_ticks=3) is old    # 6 // 3 = 2 classes
    assert pick([fresh, old], starvation_ticks=8) is fresh


def test_aged_lane_rises_to_interactive_but_an_earlier_interactive_stays_ahead():
    chat = queued("interactive")
    old = queued("background", waited=80)
    assert pick([chat, old]) is chat
    assert pick([old, chat]) is old


def test_class_cap_skips_a_capped_class_but_not_others():
    caps = {"class-lanes": {"background": 2, "interactive": 1}}
    running = [decoding("background"), decoding("background"), decoding("agent")]
    bg, ag = queued("background"), queued("agent")
    # background is at its cap: the agent behind it goes first; with only background queued, nothing
    assert pick([bg, ag], running, extra=caps) is ag
    assert pick([bg], running, extra=caps) is None
    # one background lane fewer: under the cap again
    assert pick([bg], running[1:], extra=caps) is bg
    # interactive at its cap is skipped; background under its cap is not
    chat = queued("interactive")
    assert pick([chat, bg], [decoding("interactive")], extra=caps) is bg
    assert pick([chat, bg], [decoding("agent")], extra=caps) is chat


def test_class_cap_applies_to_aged_lanes_too():
    caps = {"class-lanes": {"background": 1}}
    old = queued("background", waited=100)
    fresh = queued("agent")
    assert pick([old, fresh], [decoding("background")], extra=caps) is fresh


def test_no_class_lanes_means_no_caps():
    running = [decoding("background") for _ in range(7)]
    bg = queued("background")
    assert pick([bg], running) is bg
    assert pick([bg], running, extra={"class-lanes": {}}) is bg


def test_waiting_batch_invariant_blocks_its_class_and_below():
    inv = queued("agent", invariant=True)
    ag, bg = queued("agent"), queued("background")
    # queued behind same-class and lower-class work, it still goes first ...
    assert pick([ag, bg, inv]) is inv
    # ... and while it waits (here: its class is at its cap) nothing at or below its class is admitted
    caps = {"class-lanes": {"agent": 1}}
    assert pick([ag, bg, inv], [decoding("agent")], extra=caps) is None


def test_waiting_batch_invariant_does_not_block_more_urgent_classes():
    inv = queued("agent", invariant=True)
    chat, fim, ag = queued("interactive"), queued("completion"), queued("agent")
    assert pick([inv, ag, fim]) is fim
    assert pick([inv, ag, fim, chat]) is chat
    caps = {"class-lanes": {"agent": 1}}
    assert pick([inv, ag, fim], [decoding("agent")], extra=caps) is fim


def test_waiting_background_batch_invariant_blocks_background_only():
    inv = queued("background", invariant=True)
    bg, ag = queued("background"), queued("agent")
    assert pick([bg, inv, ag]) is ag
    assert pick([bg, inv]) is inv


def test_two_waiting_batch_invariant_lanes_are_taken_in_class_then_queue_order():
    bg_inv = queued("background", invariant=True)
    ag_inv1, ag_inv2 = queued("agent", invariant=True), queued("agent", invariant=True)
    ag = queued("agent")
    assert pick([bg_inv, ag, ag_inv1, ag_inv2]) is ag_inv1
    assert pick([bg_inv, ag, ag_inv2]) is ag_inv2
    assert pick([bg_inv, ag]) is ag        # above the background invariant lane's class


# ---- choose_victim ------------------------------------------------------------------------------------

def victim(candidate, lanes):
    return admission.choose_victim(candidate, list(lanes))


@pytest.mark.parametrize("cls", ["agent", "background"])
def test_no_victim_for_agent_or_background_candidates(cls):
    running = [decoding("background"), decoding("background")]
    assert victim(queued(cls), running) is None
    assert victim(queued(cls, waited=1000), running) is None  # aging does not confer preemption


@pytest.mark.parametrize("cls", ["interactive", "completion"])
def test_victim_is_the_lowest_class_below_the_candidate(cls):
    ag, bg = decoding("agent"), decoding("background")
    assert victim(queued(cls), [ag, bg]) is bg
    assert victim(queued(cls), [bg, ag]) is bg
    assert victim(queued(cls), [ag, decoding("agent")]) is not None


def test_among_prefilling_victims_the_one_with_the_least_computed_loses():
    """Agents admitted in one pass share their admission time: the chat takes the lane of the one
    with the least of its prompt computed (not the one that happens to be listed first), and among
    those with none, the one that arrived last."""
    started = prefilling("agent", prompt=4000, cached=512, admitted_at=5.0)
    fresh = [prefilling("agent", prompt=4000, admitted_at=5.0) for _ in range(3)]
    assert victim(queued("interactive"), [started, *fresh]) is fresh[-1]
    assert victim(queued("interactive"), [*reversed(fresh), started]) is fresh[-1]


def test_interactive_may_preempt_completion_but_not_the_reverse():
    fim, chat = decoding("completion"), decoding("interactive")
    assert victim(queued("interactive"), [chat, fim]) is fim
    assert victim(queued("completion"), [chat, fim]) is None


@pytest.mark.parametrize("cls", ["interactive", "completion"])
def test_no_victim_when_every_lane_is_at_or_above_the_candidate(cls):
    running = [decoding("interactive"), decoding(cls), prefilling(cls)]
    assert victim(queued(cls), running) is None
    assert victim(queued(cls), []) is None


def test_decoding_lane_before_prefilling_lane_of_the_same_class():
    dec = decoding("background", admitted_at=1.0)
    pre = prefilling("background", admitted_at=2.0)   # admitted later, still not chosen
    assert victim(queued("interactive"), [pre, dec]) is dec
    assert victim(queued("interactive"), [dec, pre]) is dec
    # a resumed lane re-prefilling its tokens counts as prefilling
    resumed = prefilling("background", generated=4, admitted_at=3.0)
    assert victim(queued("interactive"), [resumed, dec]) is dec


def test_class_before_state():
    dec = decoding("agent")
    pre = prefilling("background")
    assert victim(queued("interactive"), [dec, pre]) is pre


def test_among_equals_the_last_admitted_is_chosen():
    first = decoding("background", admitted_at=1.0)
    last = decoding("background", admitted_at=5.0)
    mid = decoding("background", admitted_at=3.0)
    assert victim(queued("interactive"), [first, last, mid]) is last


@pytest.mark.parametrize("flag", ["invariant", "media"])
def test_pinned_lanes_are_never_chosen(flag):
    pinned_dec = decoding("background", **{flag: True})
    pinned_pre = prefilling("background", **{flag: True})
    ag = prefilling("agent")
    assert victim(queued("interactive"), [pinned_dec, pinned_pre, ag]) is ag
    assert victim(queued("interactive"), [pinned_dec, pinned_pre]) is None


def test_lane_pinned_property():
    assert not decoding("background").pinned
    assert decoding("background", invariant=True).pinned
    assert decoding("background", media=True).pinned


# ---- prefill budget caps ------------------------------------------------------------------------------

@pytest.mark.parametrize("rate", [0.0001, 0.0002, 0.0004, 0.0008, 0.00095])
def test_admitting_cap_is_whole_512_chunks_of_half_a_second(rate):
    lanes = [prefilling("agent", prompt=3000), prefilling("agent", prompt=3001)]
    p = plan(lanes, measured(prefill=rate), prefill_budget=4096)
    budget = p.prefill_budget
    assert budget == min(4096, (int(0.5 / rate) // 512) * 512)
    assert budget % 512 == 0 and budget >= 512
    assert budget * rate <= 0.5 or budget == 4096
    assert budget == 4096 or (budget + 512) * rate > 0.5
    assert p.prefill_tokens == budget


@pytest.mark.parametrize("rate, step", [(0.001, 384), (0.0015, 256), (0.003, 128), (0.02, 128), (1.0, 128)])
def test_admitting_cap_is_128_token_steps_when_one_chunk_takes_longer(rate, step):
    assert 512 * rate > 0.5
    lane = prefilling("agent", prompt=4000)
    p = plan([lane], measured(prefill=rate), prefill_budget=4096)
    assert p.prefill_budget == step
    assert fed(p, [lane]) == [(lane, step)]


def test_busy_cap_is_eight_seconds_when_every_lane_is_busy_and_none_finishing():
    rate = 0.004                               # 8 s holds 2000 tokens
    lanes = [prefilling("agent", prompt=3000) for _ in range(8)]
    p = plan(lanes, measured(prefill=rate), prefill_budget=4096)
    assert p.prefill_budget == 1536            # whole 512 chunks within 8 s
    assert p.prefill_tokens == 1536
    assert p.prefill_tokens * rate <= 8.0 < (p.prefill_tokens + 512) * rate
    assert p.target_s == pytest.approx(BUSY_TARGET_S)


def test_busy_tick_takes_the_configured_budget_when_it_fits_in_eight_seconds():
    rate = 0.0001
    lanes = [prefilling("agent", prompt=3000) for _ in range(8)]
    p = plan(lanes, measured(prefill=rate), prefill_budget=4096)
    assert p.prefill_budget == 4096 and p.prefill_tokens == 4096
    # on a slower model the 4096 budget still fits in 8 s with every lane busy, but a free lane
    # holds the tick to half a second
    rate = 0.0004
    p8 = plan(lanes, measured(prefill=rate), prefill_budget=4096)
    p7 = plan(lanes[:7], measured(prefill=rate), prefill_budget=4096)
    assert p8.prefill_budget == 4096
    assert p7.prefill_budget == 1024


def test_a_finishing_lane_brings_back_the_half_second_cap():
    rate = 0.0004
    decode = {7: 1 / 64}                        # 0.25 s busy target → 16 rounds
    busy = [prefilling("agent", prompt=3000)] + [decoding("agent", max_tokens=1000) for _ in range(7)]
    p = plan(busy, measured(prefill=rate, decode=decode), prefill_budget=4096, caps=NATIVE)
    assert p.prefill_budget == 4096            # 8 s cap: 20000 tokens
    finishing = busy[:-1] + [decoding("agent", generated=5, max_tokens=5 + 16)]   # 16 left ≤ 16 rounds
    p = plan(finishing, measured(prefill=rate, decode=decode), prefill_budget=4096, caps=NATIVE)
    assert p.prefill_budget == 1024            # 0.5 s: 1250 → 1024
    assert p.target_s == pytest.approx(CAPS.tick_target_free_ms / 1000.0)
    not_yet = busy[:-1] + [decoding("agent", generated=5, max_tokens=5 + 17)]
    assert plan(not_yet, measured(prefill=rate, decode=decode), prefill_budget=4096, caps=NATIVE).prefill_budget == 4096


def test_configured_budget_below_the_cap_is_kept():
    lane = prefilling("agent", prompt=3000)
    p = plan([lane], measured(prefill=0.0001), prefill_budget=300)
    assert p.prefill_budget == 300
    assert fed(p, [lane]) == [(lane, 300)]


# ---- the adaptive controller (--prefill-budget 0) -----------------------------------------------------

def busy_lanes():
    return [prefilling("agent", prompt=3500) for _ in range(8)]


def adaptive_expected(rate: float) -> int:
    return int(min(max(BUSY_TARGET_S / rate, 256), 4096))


@pytest.mark.parametrize("rate", [1e-7, 1e-5, 5e-5, 1e-4, 2e-4, 5e-4, 9.7e-4, 1e-3, 2e-3, 1e-2])
def test_adaptive_budget_is_target_over_speed_clamped(rate):
    costs = measured(prefill=rate)
    p = plan(busy_lanes(), costs, prefill_budget=0)
    assert p.prefill_budget == adaptive_expected(costs.prefill_per_token())
    assert p.prefill_budget == pytest.approx(adaptive_expected(rate), abs=1)
    assert 256 <= p.prefill_budget <= 4096
    if 256 < p.prefill_budget < 4096:   # unclamped: the prefill lands near the busy tick target
        assert p.prefill_tokens * rate == pytest.approx(BUSY_TARGET_S, rel=0.01)


def test_adaptive_budget_follows_tick_target_ms_under_the_engine_cap():
    rate = 1e-4
    p = plan(busy_lanes(), measured(prefill=rate), prefill_budget=0, tick_target_ms=100)
    assert p.prefill_budget == pytest.approx(1000, abs=1)   # 0.1 s / 1e-4
    p = plan(busy_lanes(), measured(prefill=rate), prefill_budget=0, tick_target_ms=20000)
    assert p.prefill_budget == pytest.approx(2500, abs=1)   # capped at the engine's 250 ms


@pytest.mark.parametrize("start, true_rate", [
    (None, 1e-4),      # default estimate (2 ms/token, far too slow) → 2500
    (1e-6, 5e-4),      # far too fast: starts pinned at 4096 → 500
    (1e-6, 1e-4),      # → 2500
    (0.01, 2e-4),      # → 1250
])
def test_adaptive_budget_converges_from_a_wrong_estimate(start, true_rate):
    costs = CostModel() if start is None else CostModel(prefill_s_per_token=start)
    lanes = busy_lanes()
    target = adaptive_expected(true_rate)
    history = []
    for _ in range(30):
        p = plan(lanes, costs, prefill_budget=0)
        history.append(p.prefill_budget)
        assert 256 <= p.prefill_budget <= 4096
        # the engine prefilled the tick's tokens in 512-token steps at the true speed
        left = p.prefill_tokens
        steps = []
        while left > 0:
            n = min(left, 512)
            steps.append(StepTiming(prefill_tokens=n, decode_tokens=0, seconds=n * true_rate))
            left -= n
        costs.observe(steps[:1])   # one measured step per tick: the slowest convergence
    assert history[0] != target
    assert abs(history[-1] - target) <= 0.02 * target, history
    # monotone toward the target (no overshoot with an EMA of a constant speed)
    diffs = [b - a for a, b in zip(history, history[1:])]
    assert all(d >= 0 for d in diffs) or all(d <= 0 for d in diffs), history
    # and it stays there
    for _ in range(20):
        costs.observe([StepTiming(512, 0, 512 * true_rate)])
    assert plan(lanes, costs, prefill_budget=0).prefill_budget == pytest.approx(target, rel=0.002)


# ---- prefill ordering ---------------------------------------------------------------------------------

def test_prefill_order_starving_then_class_then_shortest():
    s = settings(starvation_ticks=8)
    bg_starving_long = prefilling("background", prompt=3000, waited=8)
    ag_starving = prefilling("agent", prompt=500, waited=20)
    chat_long = prefilling("interactive", prompt=2000)
    chat_short = prefilling("interactive", prompt=50)
    fim = prefilling("completion", prompt=10)
    ag_short = prefilling("agent", prompt=100)
    ag_partly = prefilling("agent", prompt=400, cached=350)   # 50 left: shortest *remaining*
    bg = prefilling("background", prompt=5, waited=7)           # one tick short of starving
    lanes = [bg, ag_short, chat_long, bg_starving_long, fim, ag_partly, chat_short, ag_starving]
    # urgent classes first (their first token is what they are promised), then starving lanes by
    # class, then the rest by class and shortest remaining prompt
    assert planner.prefill_order(lanes, s) == [
        chat_short, chat_long, fim, ag_starving, bg_starving_long, ag_partly, ag_short, bg]


def test_prefill_order_equal_lanes_oldest_first():
    s = settings(starvation_ticks=8)
    lanes = [prefilling("agent", prompt=1000, admitted_at=t) for t in (3.0, 1.0, 2.0)]
    assert [l.admitted_at for l in planner.prefill_order(lanes, s)] == [1.0, 2.0, 3.0]


def test_plan_gives_budget_in_prefill_order():
    costs = measured(prefill=1e-5)
    bg_starving = prefilling("background", prompt=300, waited=8)
    ag_long = prefilling("agent", prompt=900)
    ag_short = prefilling("agent", prompt=200)
    bg = prefilling("background", prompt=100)
    lanes = [bg, ag_long, ag_short, bg_starving]
    p = plan(lanes, costs, prefill_budget=1000, starvation_ticks=8)
    assert fed(p, lanes) == [(bg_starving, 300), (ag_short, 200), (ag_long, 500)]
    g = grants(p, lanes)
    assert g[bg_starving].sample and g[ag_short].sample and not g[ag_long].sample
    assert g[ag_long].max_new == 0
    assert bg not in g                         # the budget ran out before it
    assert p.prefill_tokens == 1000


def test_prefill_chunk_starts_at_the_cached_position():
    costs = measured(prefill=1e-5)
    lane = prefilling("agent", prompt=1000, cached=600)
    p = plan([lane], costs, prefill_budget=256)
    lp = grants(p, [lane])[lane]
    assert lp.pos == 600 and lp.feed == lane.tokens[600:856] and not lp.sample and not lp.reset


# ---- urgent prompts finishing -------------------------------------------------------------------------

def test_finishing_interactive_prompt_prefills_nothing_lower_beside_it():
    costs = measured(prefill=1e-5, decode={2: 1 / 256})
    chat = prefilling("interactive", prompt=100)
    fim = prefilling("completion", prompt=3000)       # would get the rest of the budget, unfinished
    ag = prefilling("agent", prompt=50)               # would finish
    dec_bg, dec_ag = decoding("background"), decoding("agent")
    lanes = [ag, fim, chat, dec_bg, dec_ag]
    p = plan(lanes, costs, prefill_budget=1000)
    assert fed(p, lanes) == [(chat, 100)]
    g = grants(p, lanes)
    assert fim not in g and ag not in g
    assert g[dec_bg].decode and g[dec_ag].decode      # lower classes still decode
    assert g[chat].sample and g[chat].max_new >= 1


def test_finishing_completion_prompt_keeps_interactive_but_drops_lower():
    costs = measured(prefill=1e-5)
    fim = prefilling("completion", prompt=100, waited=8)   # starving: ranks with interactive, finishes
    ag = prefilling("agent", prompt=200, waited=8)         # starving: ranks with completion
    chat = prefilling("interactive", prompt=3000)          # partly prefilled with the rest
    lanes = [chat, ag, fim]
    p = plan(lanes, costs, prefill_budget=1000, starvation_ticks=8)
    assert fed(p, lanes) == [(fim, 100), (chat, 900)]
    assert ag not in grants(p, lanes)


def test_urgent_prompt_goes_before_a_starving_agent():
    costs = measured(prefill=1e-5)
    ag = prefilling("agent", prompt=200, waited=16)   # starved two periods
    chat = prefilling("interactive", prompt=3000)     # does not finish within the budget
    lanes = [chat, ag]
    p = plan(lanes, costs, prefill_budget=1000, starvation_ticks=8)
    assert fed(p, lanes) == [(chat, 1000)]


def test_finishing_agent_prompt_does_not_drop_background():
    costs = measured(prefill=1e-5)
    ag, bg = prefilling("agent", prompt=100), prefilling("background", prompt=100)
    p = plan([ag, bg], costs)
    assert fed(p, [ag, bg]) == [(ag, 100), (bg, 100)]


# ---- decode grants ------------------------------------------------------------------------------------

def test_busy_decode_grant_fills_the_tick_target():
    lanes = [decoding("agent", max_tokens=1000) for _ in range(8)]
    p = plan(lanes, measured(decode={8: 1 / 64}))
    assert p.decode_grant == 16                        # 0.25 s / (1/64 s)
    assert all(lp.max_new == 16 and lp.decode and len(lp.feed) == 1 for lp in p.lanes)
    for lane, lp in grants(p, lanes).items():
        assert lp.feed == lane.tokens[-1:] and lp.pos == len(lane.tokens) - 1


@pytest.mark.parametrize("budget, rounds", [(0, 16), (40, 5), (64, 8), (128, 16), (1000, 16), (8, 1)])
def test_tick_decode_budget_limits_rounds_per_lane(budget, rounds):
    lanes = [decoding("agent", max_tokens=1000) for _ in range(8)]
    p = plan(lanes, measured(decode={8: 1 / 64}), tick_decode_budget=budget)
    assert p.decode_grant == rounds
    assert [lp.max_new for lp in p.lanes] == [rounds] * 8
    if budget:
        assert sum(lp.max_new for lp in p.lanes) <= budget


def test_tick_decode_budget_divides_among_decoding_lanes_only():
    lanes = [decoding("agent", max_tokens=1000) for _ in range(4)]
    p = plan(lanes, measured(decode={4: 1 / 1024}), tick_decode_budget=20)
    assert p.decode_grant == 5
    assert [lp.max_new for lp in p.lanes] == [5] * 4


@pytest.mark.parametrize("n_decoding", [0, 2])
def test_tick_decode_budget_holds_with_a_resumed_lane(n_decoding):
    budget = 8
    resumed = prefilling("agent", prompt=100, generated=10, max_tokens=1000)   # KV dropped on preemption
    lanes = [resumed] + [decoding("agent", max_tokens=1000) for _ in range(n_decoding)]
    costs = measured(prefill=1e-5, decode={max(n_decoding, 1): 1 / 1024})
    p = plan(lanes, costs, tick_decode_budget=budget)
    g = grants(p, lanes)
    assert g[resumed].sample
    # tokens sampled in decode rounds: every decoding lane's grant, and all but the first sample
    # of the lane finishing its prefill
    decode_tokens = sum(lp.max_new - (0 if lp.decode else 1) for lp in g.values() if lp.sample)
    assert decode_tokens <= budget, {lane.id: lp.max_new for lane, lp in g.items()}


def test_decode_grant_never_exceeds_remaining_tokens_or_context():
    roomy = decoding("agent", max_tokens=1000)
    short = decoding("agent", generated=5, max_tokens=8)              # 3 left
    edge = decoding("agent", prompt=4000, generated=90, max_tokens=1000)   # 4090 of 4096: 6 left
    last = decoding("agent", prompt=4000, generated=95, max_tokens=1000)   # 1 left
    lanes = [roomy, short, edge, last] + [decoding("agent", max_tokens=1000) for _ in range(4)]
    p = plan(lanes, measured(decode={8: 1 / 1024}))
    g = grants(p, lanes)
    assert p.decode_grant > 6
    assert g[roomy].max_new == p.decode_grant
    assert g[short].max_new == 3
    assert g[edge].max_new == 6
    assert g[last].max_new == 1
    for lane, lp in g.items():
        assert 1 <= lp.max_new <= lane.remaining_tokens
        assert len(lane.tokens) + lp.max_new <= CTX


def test_prefill_finish_grant_never_exceeds_remaining_tokens_or_context():
    costs = measured(prefill=1e-6, decode={7: 1 / 64})
    near_ctx = prefilling("agent", prompt=4000, generated=90, max_tokens=1000)   # resumed, 6 from the end
    few_left = prefilling("agent", prompt=50, generated=10, max_tokens=12)       # resumed, 2 left
    lanes = [near_ctx, few_left] + [decoding("agent", max_tokens=1000) for _ in range(6)]
    p = plan(lanes, costs, prefill_budget=4096, max_batch=8)
    g = grants(p, lanes)
    assert g[few_left].sample and g[few_left].max_new == 2
    assert not g[near_ctx].sample          # 4090 tokens do not fit beside the 60 of the other
    p = plan([near_ctx] + lanes[2:], costs, prefill_budget=4096)
    g = grants(p, [near_ctx])
    assert g[near_ctx].sample and len(g[near_ctx].feed) == 4090
    assert 1 <= g[near_ctx].max_new <= 6


def test_first_token_due_ends_the_tick_after_one_round():
    costs = measured(prefill=1e-5, decode={3: 1 / 1024})
    new = prefilling("interactive", prompt=100)                 # no first token yet
    decs = [decoding("agent", max_tokens=1000) for _ in range(3)]
    p = plan([new] + decs, costs)
    g = grants(p, [new] + decs)
    assert g[new].sample and g[new].max_new == 1
    assert p.decode_grant == 1
    assert all(g[d].max_new == 1 for d in decs)
    # the same lane resumed after preemption (first token already sent) does not shorten the tick
    resumed = prefilling("interactive", prompt=100, generated=3)
    p = plan([resumed] + decs, costs)
    assert p.decode_grant > 1
    assert grants(p, [resumed])[resumed].max_new == p.decode_grant


def test_first_token_rounds_cover_the_prefill_steps_for_decoding_lanes():
    costs = measured(prefill=1e-5, decode={2: 1 / 1024})
    new = prefilling("agent", prompt=1100)                      # 3 engine steps of 512
    decs = [decoding("agent", max_tokens=1000) for _ in range(2)]
    p = plan([new] + decs, costs)
    assert p.prefill_tokens == 1100
    assert p.decode_grant == math.ceil(1100 / CAPS.prefill_step_tokens)   # they decode beside each step
    assert all(grants(p, decs)[d].max_new == 3 for d in decs)


def test_first_token_due_after_a_multi_step_prefill_gets_one_round():
    costs = measured(prefill=1e-5)
    new = prefilling("agent", prompt=1100)    # fed in 3 engine steps; its first token comes at the 3rd
    p = plan([new], costs)
    lp = grants(p, [new])[new]
    assert lp.sample and len(lp.feed) == 1100
    assert lp.max_new == 1


# ---- batch-invariant lanes ----------------------------------------------------------------------------

def test_batch_invariant_running_lane_ticks_alone():
    costs = measured(prefill=1e-5, decode={1: 1 / 1024, 4: 1 / 512})
    inv = decoding("background", invariant=True, admitted_at=5.0)
    others = [decoding("interactive"), prefilling("interactive", prompt=30), decoding("agent"),
              prefilling("agent", prompt=40)]
    p = plan(others + [inv], costs)
    assert [lp.slot for lp in p.lanes] == [inv.slot]
    assert p.lanes[0].decode and p.lanes[0].max_new >= 1


def test_batch_invariant_prefilling_lane_ticks_alone():
    costs = measured(prefill=1e-5)
    inv = prefilling("agent", prompt=300, invariant=True)
    chat = prefilling("interactive", prompt=20)
    p = plan([chat, inv, decoding("agent")], costs)
    assert [(lp.slot, len(lp.feed)) for lp in p.lanes] == [(inv.slot, 300)]


def test_two_batch_invariant_lanes_the_first_admitted_ticks():
    costs = measured(prefill=1e-5, decode={1: 1 / 1024})
    later = decoding("agent", invariant=True, admitted_at=9.0)
    earlier = decoding("agent", invariant=True, admitted_at=2.0)
    p = plan([later, earlier], costs)
    assert [lp.slot for lp in p.lanes] == [earlier.slot]


# ---- resets and plan shape ----------------------------------------------------------------------------

def test_new_lane_plan_resets_with_its_sampling():
    costs = measured(prefill=1e-5)
    lane = prefilling("agent", prompt=50)
    lp = grants(plan([lane], costs), [lane])[lane]
    assert lp.reset and lp.sampling is lane.request.sampling and lp.pos == 0
    assert not lp.decode and lp.seed.key is None


def test_empty_lanes_plan_nothing():
    p = plan([], measured(prefill=1e-5))
    assert p.lanes == [] and p.prefill_tokens == 0


# ---- --class-lanes ------------------------------------------------------------------------------------

@pytest.mark.parametrize("text, caps", [
    ("background=2,agent=6", {"background": 2, "agent": 6}),
    ("background-agent=2, foreground=6", {"background": 2, "agent": 6}),
    ("0=1,1=2,2=3,3=4", {"interactive": 1, "completion": 2, "agent": 3, "background": 4}),
    ("Interactive-Chat=1,inline-completion=2", {"interactive": 1, "completion": 2}),
    (" agent = 3 ,", {"agent": 3}),
    ("", {}),
])
def test_parse_class_lanes(text, caps):
    assert options.parse_class_lanes(text) == caps


@pytest.mark.parametrize("text, needle", [
    ("urgent=2", "unknown QoS class 'urgent'"),
    ("agent=2,batch=1", "unknown QoS class 'batch'"),
    ("agent", "expected CLASS=N"),
    ("agent:2", "expected CLASS=N"),
    ("agent=two", "must be an integer"),
    ("agent=2.5", "must be an integer"),
    ("agent=", "must be an integer"),
])
def test_parse_class_lanes_rejects(text, needle):
    with pytest.raises(ConfigError) as info:
        options.parse_class_lanes(text)
    assert needle in str(info.value)
    if "unknown" in needle:
        assert all(c in str(info.value) for c in qos.CLASSES)


def config(*models: tuple[str, int, dict]) -> Config:
    return Config(values={}, plugins=[], source="test.toml", models=[
        ModelConfig(name=name, path="", engine="fake", values={"max-batch": mb, "class-lanes": caps})
        for name, mb, caps in models])


@pytest.mark.parametrize("caps", [{}, {"agent": 1}, {"background": 8, "agent": 8},
                                  {"interactive": 1, "completion": 2, "agent": 3, "background": 4}])
def test_check_caps_accepts_caps_within_max_batch(caps):
    options.check_caps(config(("m", 8, caps)))


@pytest.mark.parametrize("cls, cap", [("agent", 0), ("background", 9), ("agent", -1), ("interactive", 100)])
def test_check_caps_rejects_caps_out_of_range(cls, cap):
    with pytest.raises(ConfigError) as info:
        options.check_caps(config(("m", 8, {"agent": 2, cls: cap})))
    msg = str(info.value)
    assert f"{cls}={cap}" in msg and "--max-batch (8)" in msg and "test.toml" in msg


def test_check_caps_is_per_model():
    ok = ("big", 8, {"agent": 6})
    options.check_caps(config(ok, ("small", 6, {"agent": 6})))
    with pytest.raises(ConfigError) as info:
        options.check_caps(config(ok, ("small", 4, {"agent": 6})))
    assert "'small'" in str(info.value) and "--max-batch (4)" in str(info.value)


def test_check_caps_without_class_lanes_value():
    cfg = Config(values={}, plugins=[], source="x", models=[
        ModelConfig(name="m", path="", engine="fake", values={"max-batch": 8})])
    options.check_caps(cfg)


def test_class_lanes_option_declared_model_scoped_with_parser():
    opt = next(o for o in options.OPTIONS if o.name == "class-lanes")
    assert opt.model_scoped and opt.default == {}
    assert opt.parse("background=2") == {"background": 2}


def test_streaming_lanes_keep_uniform_engine_ticks_near_the_target():
    """On llama.cpp/MLX tokens reach clients at tick ends and cutting ticks costs nothing, so with
    lanes decoding a tick's prefill is held near the tick target (at least one engine step)."""
    rate = 0.0004
    decode = {7: 1 / 64}
    busy = [prefilling("agent", prompt=3000)] + [decoding("agent", max_tokens=1000) for _ in range(7)]
    p = plan(busy, measured(prefill=rate, decode=decode), prefill_budget=4096)
    assert abs(p.prefill_budget - max(p.step_tokens, BUSY_TARGET_S / rate)) <= 1  # float rounding
    assert p.prefill_tokens <= p.prefill_budget
    # without decoding lanes nothing streams: the 8 s cap applies
    p = plan([prefilling("agent", prompt=3000) for _ in range(8)], measured(prefill=rate), prefill_budget=4096)
    assert p.prefill_budget == 4096


def test_streamed_lanes_hold_a_newcomers_prefill_to_the_busy_target_in_one_small_step():
    """While a client reads a stream, a tick prefills what the busy target holds, in one engine
    step (not a 512-token step: about 2 s of SmolLM2 on 2 cores, a 2 s gap in every stream),
    at least one token; without a stream the engine's own step stands."""
    rate = 0.004                                                  # 4 ms a prompt token
    costs = measured(prefill=rate, decode={4: 1 / 64})
    streams = [_watched(decoding("interactive"), streamed=True) for _ in range(4)]
    newcomer = prefilling("agent", prompt=2000)
    p = plan([newcomer] + streams, costs, prefill_budget=4096)
    fit = int(BUSY_TARGET_S / rate)                               # 62 tokens
    assert p.step_tokens == p.prefill_budget == fit == p.prefill_tokens
    assert p.prefill_tokens * rate <= BUSY_TARGET_S               # the gap: one target's prefill ...
    assert p.decode_grant == 1                                    # ... and one round beside it, no more
    # MLX on CPU kernels (0.1 s a prompt token): 2 tokens a tick, not its 128-token floor (13 s)
    p = plan([newcomer] + streams, measured(prefill=0.1, decode={4: 1 / 64}))
    assert p.step_tokens == p.prefill_tokens == 2 and p.decode_grant == 1
    p = plan([newcomer] + streams, measured(prefill=1.0, decode={4: 1 / 64}))
    assert p.step_tokens == p.prefill_tokens == 1                 # a token a tick at least
    # nobody reads a stream: the engine's step (128 here, what 0.5 s holds) and the budget stand
    quiet = [decoding("agent") for _ in range(4)]
    p = plan([newcomer] + quiet, costs, prefill_budget=4096)
    assert p.step_tokens == planner.step_tokens(costs, CAPS) == 128 > fit
    assert p.prefill_tokens == max(p.step_tokens, int(BUSY_TARGET_S / rate))


def test_a_stream_about_to_end_takes_its_last_rounds_before_the_prefill_goes_on():
    """An agent's 16-token reply beside the next agent's long prompt: held to the busy target, that
    prompt would prefill in ~60-token steps for 15 ticks (on 2 CPU cores 48-token steps run at
    two thirds of 256-token ones). The reply's last 15 tokens go in one tick of their own
    instead; an urgent prompt's prefill does not wait for them, nor does a prompt short enough to
    end first (a second chat's first token would wait for the whole reply), nor does a stream far
    from its end."""
    rate, round_s = 0.004, 0.011                                  # 22 rounds fit the busy target
    costs = measured(prefill=rate, decode={1: round_s})
    ending = _watched(decoding("agent", generated=1, max_tokens=16), streamed=True)
    assert ending.remaining_tokens == 15
    newcomer = prefilling("agent", prompt=4000)
    p = plan([newcomer, ending], costs)
    assert fed(p, [newcomer, ending]) == [] and p.prefill_tokens == 0
    assert p.decode_grant == 15 and grants(p, [ending])[ending].max_new == 15
    # a chat's prompt still prefills beside it, in the stream's small step
    chat = prefilling("interactive", prompt=30)
    p = plan([chat, newcomer, ending], costs)
    assert fed(p, [chat, newcomer, ending])[0] == (chat, 30)
    # a short prompt the small steps finish before the reply ends keeps its place
    second = prefilling("agent", prompt=30)
    p = plan([second, ending], costs)
    assert fed(p, [second, ending]) == [(second, 30)]
    # a stream with more left than a tick holds: the prefill goes on in small steps
    far = _watched(decoding("agent", generated=1, max_tokens=200), streamed=True)
    p = plan([newcomer, far], costs)
    assert fed(p, [newcomer, far]) == [(newcomer, int(BUSY_TARGET_S / rate))] and p.decode_grant == 1
    # nobody reads the ending reply: nothing holds the prefill to small steps, nothing waits
    unread = decoding("agent", generated=1, max_tokens=16)
    p = plan([newcomer, unread], costs)
    assert fed(p, [newcomer, unread]) and fed(p, [newcomer, unread])[0][0] is newcomer


def test_a_step_keeps_its_floor_only_while_the_floor_fits_the_ceiling():
    """An engine that cannot abort a step in flight: steps shrink toward what 0.5 s holds, but keep
    128 tokens (an accelerator's batching) unless 128 tokens take more than 2 s. On MLX's CPU
    kernels (0.1 s a prompt token) a 128-token step held a dropped request or a chat's preemption
    for 13 s; there a step holds what 2 s does."""
    def step(rate):
        return planner.step_tokens(measured(prefill=rate), CAPS)
    assert step(1e-5) == CAPS.prefill_step_tokens                      # fast: the engine's own step
    assert step(0.004) == 128                                          # 0.5 s holds 125: the floor
    assert step(0.0155) == 128 and 128 * 0.0155 <= 2.0                 # the floor still fits 2 s
    assert step(0.1) == 20                                             # MLX on CPU: 2 s, not 12.8 s
    assert step(3.0) == 1                                              # a token at least
    assert all(step(r) * r <= 2.0 for r in (0.016, 0.05, 0.1, 1.0))


def test_an_unmeasured_engine_probes_with_small_steps_then_sizes_them_from_the_measurement():
    """A fresh server's rate is a guess (2 ms a token). An engine that cannot abort a step takes
    32-token steps until one is measured; on MLX's CPU kernels the guess had sized 12.5 s steps.
    One measured step is enough: MLX's 0.1 s a token then gives 2 s steps at once."""
    fresh = CostModel()
    assert not fresh.prefill_measured
    assert planner.step_tokens(fresh, CAPS) == planner.PROBE_STEP == 32
    assert planner.step_tokens(fresh, attrs.evolve(CAPS, aborts_mid_step=True)) == CAPS.prefill_step_tokens
    fresh.observe([StepTiming(prefill_tokens=32, decode_tokens=0, seconds=3.2)])
    assert planner.step_tokens(fresh, CAPS) == 20


# ---- quiet ticks ------------------------------------------------------------------------------------

QUIET = {"quiet-ticks": True}


def _watched(lane: Lane, **changes) -> Lane:
    lane.request = attrs.evolve(lane.request, **changes)
    return lane


def test_a_quiet_tick_runs_to_the_busy_target_with_lanes_free():
    decode = {2: 0.01}
    lanes = [decoding("agent"), decoding("background")]           # 6 of 8 lanes free
    p = plan(lanes, measured(decode=decode), extra=QUIET)
    assert p.quiet
    assert p.target_s == pytest.approx(BUSY_TARGET_S)
    assert p.decode_grant == 25                                   # 0.25 s of 10 ms rounds, not 5


def test_quiet_ticks_off_by_default_keeps_the_free_lane_target():
    lanes = [decoding("agent"), decoding("background")]
    p = planner.plan_tick(lanes, [], measured(decode={2: 0.01}), CAPS, settings())
    assert not p.quiet
    assert p.target_s == pytest.approx(CAPS.tick_target_free_ms / 1000.0)
    assert p.decode_grant == 5


@pytest.mark.parametrize("why", ["queued", "prefilling", "streamed", "stop strings", "no mid-tick stop"])
def test_a_tick_someone_waits_on_is_not_quiet(why):
    decode = {2: 0.01}
    lanes = [decoding("agent"), decoding("agent")]
    queue, caps = [], CAPS
    if why == "queued":
        queue = [queued("background")]
    elif why == "prefilling":
        lanes[1] = prefilling("agent", prompt=100)
    elif why == "streamed":
        _watched(lanes[1], streamed=True)
    elif why == "stop strings":
        _watched(lanes[1], stop=("\n\n",))
    else:
        caps = attrs.evolve(CAPS, stops_mid_tick=False)
    p = plan(lanes, measured(prefill=0.001, decode=decode), queue=queue, caps=caps, extra=QUIET)
    assert not p.quiet
    assert p.target_s == pytest.approx(CAPS.tick_target_free_ms / 1000.0)
