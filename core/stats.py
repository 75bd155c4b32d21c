"""What the scheduler tells observers: a tick's stats, a lane's timings, the /slots view."""

from __future__ import annotations

from typing import TYPE_CHECKING

import attrs

from .lane import Lane

if TYPE_CHECKING:
    from .scheduler import Scheduler


@attrs.define
class TickStats:
    """What one tick did, for observers (metrics, logs)."""

    model: str
    seconds: float
    prefill_tokens: int
    decode_tokens: int
    prefill_budget: int
    decode_grant: int
    lanes_busy: int
    max_lanes: int
    queue_depth: int
    stopped_early: bool
    kv_used: int
    kv_capacity: int
    first_tokens: list[tuple[str, float]]  # (qos class, seconds from admission) per new first token
    finished: list[Lane]
    queue_by_class: dict[str, int]
    lanes_by_class: dict[str, int]
    preempted: int = 0     # lanes preempted while planning this tick
    promoted: int = 0      # lanes admitted after waiting the starvation bound
    parked_bytes: int = 0  # KV bytes the engine holds parked in host memory
    quiet: bool = False    # the tick was a quiet one (TickPlan.quiet)
    target_s: float | None = None  # the length the plan aimed at (TickPlan.target_s)
    cache_hits: int = 0         # lanes seeded from the prefix cache (or a running lane) while planning
    cache_hit_tokens: int = 0   # prompt tokens those lanes did not have to prefill
    cache_host_hits: int = 0    # of those lanes, the ones seeded from a prefix held in host memory
    cached_tokens: int = 0      # tokens held as cached prefixes in free slots
    evictions: dict = attrs.field(factory=dict)  # cached prefixes evicted, by reason
    host_entries: int = 0       # prefixes held in host memory
    host_bytes: int = 0
    pressure: str = "ok"        # the worst level the pressure sources reported
    pool_rejections: int = 0    # plans the KV pool could not hold (freed room and retried)
    drafted_tokens: int = 0     # speculative decoding: tokens drafted for verification this tick
    accepted_tokens: int = 0    # of those, the ones the model accepted
    verify_steps: int = 0       # steps that verified at least one draft
    images_encoded: int = 0     # images the vision encoder ran on (not served from its cache)
    # what the prefix cache stored, removed or cleared since the last tick, in order
    # (core.cache_events.CacheEvent: references to token lists, never copies; the kvevents
    # plugin builds its KV events from them)
    cache_events: list = attrs.field(factory=list)


def count_by_class(lanes: list[Lane]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for lane in lanes:
        counts[lane.qos] = counts.get(lane.qos, 0) + 1
    return counts


def timings(lane: Lane) -> dict:
    """A lane's timestamps (monotonic seconds), sent with its last event."""
    return {"queued_at": lane.queued_at, "admitted_at": lane.admitted_at,
            "first_token_at": lane.first_token_at, "finished_at": lane.finished_at,
            "arrived": lane.request.arrived, "prefilled": lane.n_prefilled}


def snapshot(sched: Scheduler, now: float) -> dict:
    """Per-slot state for /slots (call with the model's lock held)."""
    kv = sched.kv
    by_slot = {lane.slot: lane for lane in sched.lanes}
    slots = []
    for slot in range(kv.n_slots):  # the lanes' slots and the engine's spare ones
        lane = by_slot.get(slot)
        if lane is None:
            slots.append({"id": slot, "state": "free", "cached_tokens": len(kv.cache.tokens(slot))})
        else:
            slots.append(_lane_view(slot, lane, now))
    return {"model": sched.name, "slots": slots, "max_batch": sched.settings.max_batch,  # how many may be busy
            "queued": len(sched.queue),
            "queue": [{"request_id": l.id, "qos": l.qos, "waited_s": round(now - l.queued_at, 3),
                       "parked": l.parked is not None} for l in sched.queue],
            "ticks": sched.ticks, "kv_used": kv.used, "kv_capacity": kv.capacity,
            "kv_cached": kv.cache.cached_tokens(),
            "pinned_prefixes": len(kv.pins),  # --pin-prompt's and open sessions' system prompts
            "parked_bytes": max(0, kv.parked_bytes - kv.host.bytes),  # by preempted lanes
            "host_cache_bytes": kv.host.bytes,
            "host_cache_entries": len(kv.host), "pressure": sched.pressure,  # for /events
            "costs": sched.costs.as_dict()}


def _lane_view(slot: int, lane: Lane, now: float) -> dict:
    view = {"id": slot, "state": lane.state.value, "request_id": lane.id, "qos": lane.qos,
            "prompt_tokens": lane.n_prompt, "cached_tokens": lane.n_cached,
            "generated_tokens": lane.n_generated, "max_tokens": lane.request.max_tokens,
            "prefilled_tokens": lane.n_prefilled, "preemptions": lane.preemptions}
    if lane.request.media:  # a media lane: never preempted
        view["images"] = len({span.image.digest for span in lane.request.media})  # a span per tile
    if lane.admitted_at is not None and lane.n_prefilled:
        end = lane.first_token_at or now
        view["prefill_tokens_per_s"] = round(lane.n_prefilled / max(end - lane.admitted_at, 1e-6), 1)
    if lane.first_token_at is not None and lane.n_generated > 1:
        view["decode_tokens_per_s"] = round((lane.n_generated - 1) / max(now - lane.first_token_at, 1e-6), 1)
    return view
