"""The room in the KV pool: the prefix cache and its host tier, how cached prefixes make room
when the pool is short (watermarks, a refused plan, the OS's memory pressure), and the books of
what changed (cache events, eviction counts, hits) that each tick's stats take.

:class:`KVRoom` is the base of the KV manager (``core/kv.py``), which adds the lanes: which slot
a lane gets, what seeds it, parking and releasing. Evictions only ever take cached prefixes of
free slots, never a live lane's KV; the engine operations they need (park to host, release)
are queued here and carried by the next plan."""

from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING

from .cache_events import CacheEvent, ReportingHostTier
from .lane import Lane
from .pool_limit import PoolLimit, PoolVerdict
from .prefix import SlotCache

if TYPE_CHECKING:
    from .engine import EngineCapabilities
    from .settings import SchedulerSettings

log = logging.getLogger("superfluid.kv")

# after OS pressure, nothing moves to host memory for this long; SUPERFLUID_TEST_HOST_PAUSE_S is a
# test-only override (the chaos suite's CI memory-pressure variant waits it out instead of 30 s)
HOST_PAUSE_S = float(os.environ.get("SUPERFLUID_TEST_HOST_PAUSE_S") or 30.0)

# Tokens of evicted caches one tick moves to host memory before further admissions that would
# evict more wait for the next tick (urgent classes never wait). A park copies the cache out of
# the pool at the start of the tick, while every stream waits: on a 2-core AMD EPYC, SmolLM2's KV
# (23 KB a token) parks at about 0.45 GB/s, and eight streams arriving at once evicted seven
# caches, 160 MB, in one tick: 0.36-0.39 s on top of the 0.25 s busy target, the streams'
# largest gap 0.44-0.53 s instead of 0.36 s. 1,024 tokens is about 50 ms there.
PARK_TOKENS_PER_TICK = 1024


class KVRoom:
    def __init__(self, name: str, capabilities: EngineCapabilities, settings: SchedulerSettings):
        self.name = name
        self.caps = capabilities
        self.settings = settings
        self.pins = [list(p) for p in settings.pinned_tokens]
        self.cache = SlotCache(self.pins)
        self.cache_events: list[CacheEvent] = []  # since the last tick's stats
        self.host = ReportingHostTier(settings.host_cache_bytes, self.cache_events)
        self.used, self.capacity, self.parked_bytes = 0, 0, 0
        # engine operations for the next plan
        self._release: list[int] = []
        self._park: list[tuple[int, str]] = []
        self._park_tokens = 0  # tokens the queued parks copy (PARK_TOKENS_PER_TICK)
        self._drop_parked: list[str] = []
        self._host_paused_until = 0.0
        self.limit = PoolLimit(name, settings)
        # counters since the last tick's stats
        self.evictions: dict[str, int] = {}
        self.hits = self.hit_tokens = self.rejections = self.host_hits = 0

    def pin(self, tokens: list[int], pin: bool = True) -> None:
        """Pin (or unpin) a prefix: a pinned cached prefix is evicted last."""
        if pin:
            self.pins.append(tokens)
            self.cache.pin(tokens)
        else:
            if tokens in self.pins:
                self.pins.remove(tokens)
            self.cache.unpin(tokens)

    # ---- making room ----------------------------------------------------------------------------

    @property
    def occupancy(self) -> float:
        return self.used / self.capacity if self.capacity else 0.0

    def relieve(self) -> None:
        """Watermarks: at --pressure-high occupancy evict cached prefixes (least recently used
        first) down to --pressure-low. Live lanes are never evicted."""
        if not self.capacity or self.occupancy < self.settings.pressure_high:
            return
        used = self.used
        for slot in self.cache.lru_slots():
            if used / self.capacity <= self.settings.pressure_low:
                break
            used -= self._evict(slot, "watermark")

    def _bound_shared_cache(self) -> None:
        """In a shared pool cached prefixes take cells the lanes could use: keep at most one lane's
        context of them (--max-context cells), moving the rest to host memory, least recently
        used first (pinned ones last), so a waiting entry costs the lanes nothing."""
        over = self.cache.cached_tokens() - self.settings.context_length
        for slot in self.cache.lru_slots():
            if over <= 0:
                break
            over -= self._evict(slot, "cache_bound")

    def pool_refused(self, refused: int, lanes: list[Lane], progressed: bool) -> PoolVerdict:
        """The engine's KV pool could not hold the plan's next step (``refused`` tokens). Free at
        least the shortfall: cached prefixes first (unpinned least recently used first, pinned
        last); with none left, requeue the newest lanes (they resume from their tokens) and admit
        no more lanes than the pool then holds. After repeated refusals with no progress and
        nothing left to free, the newest lane fails (:meth:`PoolLimit.give_way`)."""
        self.rejections += 1
        self.limit.refused(progressed)
        short = max(1, refused - max(0, self.capacity - self.used))
        freed = 0
        for slot in self.cache.lru_slots():
            if freed >= short:
                break
            freed += self._evict(slot, "pool_full")
        if freed:
            log.info("model %s: KV pool full (%d tokens refused): evicted %d cached tokens",
                     self.name, refused, freed)
            return PoolVerdict()
        return self.limit.give_way(lanes, short, refused)

    def pool_progressed(self) -> None:
        self.limit.progressed()

    def os_pressure(self, level: str, now: float) -> None:
        """OS memory pressure ("warning" or "critical"): drop the host tier and keep it closed for
        a while, and evict cached prefixes (pinned ones only when critical or nothing else is
        left)."""
        self._host_paused_until = now + HOST_PAUSE_S
        dropped = self.host.clear()
        self._drop_parked.extend(dropped)
        if dropped:
            self._count("host_os_pressure", len(dropped))
        slots = self.cache.lru_slots()
        unpinned = [s for s in slots if not self.cache.pinned(s)]
        if level == "warning" and unpinned:
            slots = unpinned
        for slot in slots:
            self.cache.forget(slot)
            self._release.append(slot)
            self._report("removed", slot)
        if slots:
            self._count("os_pressure", len(slots))

    # ---- helpers ------------------------------------------------------------------------------

    def _host_open(self) -> bool:
        """Nothing moves to host memory for a while after OS memory pressure."""
        return self.caps.supports_parking and time.monotonic() >= self._host_paused_until

    def _evict(self, slot: int, reason: str) -> int:
        """Evict a free slot's cached prefix (to the host tier if it takes it); its length."""
        tokens = self.cache.tokens(slot)
        self._evict_to_host(slot, tokens, reason)
        self.cache.forget(slot)
        self._release.append(slot)
        self._report("removed", slot)
        return len(tokens)

    def _evict_to_host(self, slot: int, tokens: list[int], reason: str) -> None:
        key = self.host.add(tokens, adapters=self.cache.adapters(slot)) if self._host_open() else None
        if key is not None:
            self._park.append((slot, key))
            self._park_tokens += len(tokens)
        self._count(reason)

    def parks_full(self) -> bool:
        """Whether the parks queued for the next tick already copy PARK_TOKENS_PER_TICK tokens:
        a lane whose admission may evict another cache then waits a tick (unless urgent)."""
        return self._park_tokens >= PARK_TOKENS_PER_TICK

    # ---- the books ------------------------------------------------------------------------------

    def _count(self, reason: str, n: int = 1) -> None:
        self.evictions[reason] = self.evictions.get(reason, 0) + n

    def _held(self, slot: int, tokens: list[int], length: int, adapters: tuple = ()) -> None:
        self.cache_events.append(CacheEvent("stored", "gpu", slot, tokens, length, adapters))

    def _report(self, kind: str, slot: int) -> None:
        self.cache_events.append(CacheEvent(kind, "gpu", slot))

    def take_cache_events(self) -> list[CacheEvent]:
        """What the prefix cache stored, removed or cleared since the last call, in order."""
        if not self.cache_events:
            return []
        out = list(self.cache_events)
        self.cache_events.clear()  # the same list: the host tier appends to it
        return out

    def take_counters(self) -> tuple[dict[str, int], int, int, int, int]:
        """(evictions by reason, cache hits, hit tokens, refused plans, hits seeded from host
        memory) since the last call."""
        out = (self.evictions, self.hits, self.hit_tokens, self.rejections, self.host_hits)
        self.evictions, self.hits, self.hit_tokens, self.rejections, self.host_hits = {}, 0, 0, 0, 0
        return out
