"""Admission order: the head of the most urgent class, with aging so nothing starves."""

from __future__ import annotations

from superfluid.core import qos
from superfluid.core.lane import Lane


def effective_priority(lane: Lane, starvation_ticks: int) -> int:
    """A queued lane rises one class per ``starvation_ticks`` ticks waited."""
    rise = lane.waited_ticks // max(starvation_ticks, 1)
    return max(0, qos.priority(lane.qos) - rise)


def pick_next(queue: list[Lane], lanes: list[Lane], settings) -> Lane | None:
    """The first queued lane of the most urgent (aged) class whose class is under its lane cap."""
    caps: dict[str, int] = settings.extra.get("class-lanes") or {}
    running: dict[str, int] = {}
    for lane in lanes:
        running[lane.qos] = running.get(lane.qos, 0) + 1
    best: Lane | None = None
    best_key = None
    for position, lane in enumerate(queue):
        cap = caps.get(lane.qos)
        if cap is not None and running.get(lane.qos, 0) >= cap:
            continue
        key = (effective_priority(lane, settings.starvation_ticks), position)
        if best_key is None or key < best_key:
            best, best_key = lane, key
    return best
