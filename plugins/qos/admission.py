"""Admission order: the head of the most urgent class, with aging so nothing starves.

A class at its lane cap (``--class-lanes``) is skipped. While a batch-invariant lane waits,
nothing at or below its class is admitted ahead of it (it needs a lane to tick alone). A media
lane below the urgent classes never takes the last lanes that could be preempted
(``--urgent-lanes``, :func:`leaves_urgent_lanes`)."""

from __future__ import annotations

from superfluid.core import qos
from superfluid.core.lane import Lane

from .options import OPTIONS


def effective_priority(lane: Lane, starvation_ticks: int) -> int:
    """A queued lane rises one class per ``starvation_ticks`` ticks waited."""
    rise = lane.waited_ticks // max(starvation_ticks, 1)
    return max(0, qos.priority(lane.qos) - rise)


def pick_next(queue: list[Lane], lanes: list[Lane], settings, free_lanes: int = 1,
              pressure: str = "ok") -> Lane | None:
    """The lane to admit next. With a lane free, by effective priority (aging lifts a lane one
    class per --starvation-ticks); with none free only a preemption can admit, and the right to
    preempt is the lane's own class: the most urgent class by its own priority comes first, as
    aging orders admission but does not take that right away. Under critical OS pressure no
    background lane is admitted."""
    caps: dict[str, int] = OPTIONS.of(settings).class_lanes or {}
    running: dict[str, int] = {}
    for lane in lanes:
        running[lane.qos] = running.get(lane.qos, 0) + 1
    pinned = sum(1 for lane in lanes if lane.pinned)
    waiting_invariant = [qos.priority(l.qos) for l in queue if l.request.batch_invariant]
    floor = min(waiting_invariant) if waiting_invariant else None
    best: Lane | None = None
    best_key = None
    for position, lane in enumerate(queue):
        if pressure == "critical" and lane.qos == "background":
            continue
        cap = caps.get(lane.qos)
        if cap is not None and running.get(lane.qos, 0) >= cap:
            continue
        if (floor is not None and not lane.request.batch_invariant
                and qos.priority(lane.qos) >= floor):
            continue
        if not leaves_urgent_lanes(lane, pinned, settings):
            continue
        rank = effective_priority(lane, settings.starvation_ticks) if free_lanes else qos.priority(lane.qos)
        key = (rank, position)
        if best_key is None or key < best_key:
            best, best_key = lane, key
    return best


def leaves_urgent_lanes(lane: Lane, pinned: int, settings) -> bool:
    """Whether admitting ``lane`` leaves ``--urgent-lanes`` lanes that an interactive or completion
    request can take: free, or held by a lane it may preempt. A media lane is never preempted, so
    a media lane below the urgent classes is admitted only while the pinned lanes (media,
    batch-invariant) number fewer than ``max_batch - urgent_lanes``. Otherwise a chat arriving
    while media lanes hold every lane waits for one to finish: 5.4 s behind a 300-token reply on
    the tiny SmolVLM (docs/benchmarks.md). With one lane there is nothing to keep."""
    if not lane.request.media or lane.qos in qos.URGENT:
        return True
    keep = min(OPTIONS.of(settings).urgent_lanes or 0, settings.max_batch - 1)
    return pinned + 1 <= settings.max_batch - keep


def choose_victim(lane: Lane, lanes: list[Lane]) -> Lane | None:
    """For a queued interactive or completion lane: the lowest-class running lane below it,
    a decoding one before a prefilling one, never a pinned (batch-invariant, media) lane.
    Among prefilling lanes, the one with the least of its prompt computed loses the least work;
    among equals, the one admitted last (agents admitted together: the one that arrived last)."""
    if lane.qos not in qos.URGENT:
        return None
    mine = qos.priority(lane.qos)
    candidates = [l for l in lanes if not l.pinned and qos.priority(l.qos) > mine]
    if not candidates:
        return None
    return max(candidates, key=lambda l: (qos.priority(l.qos), not l.is_prefilling,
                                          -l.n_cached if l.is_prefilling else 0, l.seniority))


def pressure_victims(level: str, lanes: list[Lane]) -> list[Lane]:
    """Under critical OS pressure every decoding background lane is preempted (its KV is the
    cheapest to give back: it is not waiting on a prompt it has not finished)."""
    if level != "critical":
        return []
    return [l for l in lanes if l.qos == "background" and not l.is_prefilling and not l.pinned]
