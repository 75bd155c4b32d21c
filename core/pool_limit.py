"""After the KV pool refused a plan: how many lanes it holds for now, and which lanes give way
when no cached prefix is left to free.

The KV manager (``core/kv.py``) frees cached prefixes first and asks this only when that is not
enough. The limit it sets rises again, one lane at a time, while the live lanes' cells and what
they still have to prefill stay under --pressure-low."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import attrs

from .lane import Lane

if TYPE_CHECKING:
    from .prefix import SlotCache
    from .settings import SchedulerSettings

log = logging.getLogger("superfluid.kv")

POOL_STUCK_TICKS = 3  # refused plans in a row without progress before the newest lane fails


@attrs.frozen
class PoolVerdict:
    """What to do after the KV pool refused a plan: lanes to requeue, or one to fail."""

    requeue: list[Lane] = attrs.field(factory=list)
    fail: Lane | None = None


class PoolLimit:
    def __init__(self, name: str, settings: SchedulerSettings):
        self.name = name
        self.settings = settings
        self.cap: int | None = None  # most lanes the pool holds for now (None: no limit)
        self.stuck = 0               # refused plans in a row without progress

    def room_for(self, lane: Lane, lanes: list[Lane], used: int, capacity: int, cache: SlotCache) -> bool:
        """Whether the KV pool has room for one more lane. Unbounded until the pool has refused a
        plan; then no more lanes than it held are admitted, plus one whenever the live lanes'
        cells, what they still have to prefill and ``lane``'s prompt stay under --pressure-low."""
        if self.cap is None or len(lanes) < self.cap:
            return True
        live = max(0, used - cache.cached_tokens())  # cached prefixes can be evicted
        pending = sum(l.to_feed for l in lanes if l.is_prefilling) + lane.to_feed
        if capacity and live + pending <= capacity * self.settings.pressure_low:
            self.cap += 1
            if self.cap >= self.settings.max_batch:
                self.cap = None
            return True
        return False

    def refused(self, progressed: bool) -> None:
        """The pool refused a plan; ``progressed``: the tick still fed or sampled tokens."""
        self.stuck = 0 if progressed else self.stuck + 1

    def progressed(self) -> None:
        self.stuck = 0

    def give_way(self, lanes: list[Lane], short: int, refused: int) -> PoolVerdict:
        """No cached prefix is left to free the ``short`` tokens: requeue the newest lanes (they
        resume from their tokens; one lane always stays, the pool holds it alone) and admit no
        more lanes than the pool then holds. After repeated refusals with no progress and no
        lane to requeue, the newest lane fails."""
        requeue, freed = [], 0
        victims = sorted((l for l in lanes if not l.pinned), key=lambda l: l.admitted_at or 0.0)
        victims = victims[-(len(lanes) - 1):] if len(lanes) > 1 else []
        while victims and freed < short:
            lane = victims.pop()  # newest first
            freed += lane.n_cached + (lane.to_feed if lane.is_prefilling else 1)  # its cells and its demand
            log.info("model %s: KV pool full (%d tokens refused): requeueing %s", self.name, refused, lane.id)
            requeue.append(lane)
        if requeue:
            self.cap = max(1, len(lanes) - len(requeue))
            return PoolVerdict(requeue=requeue)
        if self.stuck >= POOL_STUCK_TICKS and lanes:
            return PoolVerdict(fail=max(lanes, key=lambda l: l.admitted_at or 0.0))
        return PoolVerdict()
