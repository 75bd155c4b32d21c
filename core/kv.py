"""The KV manager: which slot a lane gets and what seeds it, the prefix cache and its host tier,
park artifacts, and the pool's pressure (watermarks, refused plans, the OS's).

It answers the scheduler (which slot, which seed, which lanes to give up) and queues the engine
operations those answers need (park, load, save, drop, release) until the next plan carries
them. It never calls back into the scheduler: lanes it names are preempted or failed there.
``core/prefix.py`` holds the data structures it keeps.

It also reports what the prefix cache holds as it changes (``core/cache_events.py``)."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import attrs

from .artifacts import Artifacts
from .cache_events import CacheEvent, ReportingHostTier
from .lane import Lane
from .prefix import MIN_REUSE, SlotCache, common_prefix, span
from .seeding import kv_source, may_reuse, waiting_for_donors

from .tick import OWN, Seed, TickPlan, TickResult

if TYPE_CHECKING:
    from .engine import EngineCapabilities
    from .settings import SchedulerSettings

log = logging.getLogger("superfluid.kv")

HOST_PAUSE_S = 30.0  # after OS pressure, nothing moves to host memory for this long
POOL_STUCK_TICKS = 3  # refused plans in a row without progress before the newest lane fails


@attrs.define
class PoolVerdict:
    """What to do after the KV pool refused a plan: lanes to requeue, or one to fail."""

    requeue: list[Lane] = attrs.field(factory=list)
    fail: Lane | None = None


class KVManager:
    def __init__(self, name: str, capabilities: EngineCapabilities, settings: SchedulerSettings):
        self.name = name
        self.caps = capabilities
        self.settings = settings
        self.free = list(range(settings.max_batch - 1, -1, -1))
        self.pins = [list(p) for p in settings.pinned_tokens]
        self.cache = SlotCache(self.pins)
        self.cache_events: list[CacheEvent] = []  # since the last tick's stats
        self.host = ReportingHostTier(settings.host_cache_bytes, self.cache_events)
        self.used, self.capacity, self.parked_bytes = 0, 0, 0
        # engine operations for the next plan
        self._release: list[int] = []
        self._park: list[tuple[int, str]] = []
        self._drop_parked: list[str] = []
        self._parked: dict[str, Lane] = {}   # park key -> the preempted lane whose KV it holds
        self.artifacts = Artifacts(name)
        self._copy_sources: set[int] = set()  # free slots lanes copy from this tick: keep them whole
        self._host_paused_until = 0.0
        self._pool_cap: int | None = None  # after the pool refused a plan: most lanes it holds for now
        self._pool_stuck = 0
        # counters since the last tick's stats
        self.evictions: dict[str, int] = {}
        self.hits = self.hit_tokens = self.rejections = 0

    # ---- work for the next tick -------------------------------------------------------------

    def has_work(self) -> bool:
        return bool(self._release or self._drop_parked or self.artifacts.has_work())

    def pin(self, tokens: list[int], pin: bool = True) -> None:
        if pin:
            self.pins.append(tokens)
            self.cache.pin(tokens)
        else:
            if tokens in self.pins:
                self.pins.remove(tokens)
            self.cache.unpin(tokens)

    def fill_plan(self, plan: TickPlan) -> None:
        """Add the queued engine operations to ``plan``, in the order the engine applies them."""
        plan.park.extend(self._park)
        self.artifacts.fill_plan(plan, self.free, self.cache, self.host)
        plan.drop_parked.extend(self._drop_parked)
        plan.release.extend(self._release)
        for ops in (self._park, self._drop_parked, self._release):
            ops.clear()

    # ---- admission ----------------------------------------------------------------------------

    def begin_admission(self) -> None:
        self._copy_sources = set()

    def slot_state(self) -> str:
        """"free" when a lane can be bound now, "full" when none is free (preempt for it),
        "later" when every free slot is a cache other lanes copy from this tick."""
        if not self.free:
            return "full"
        return "later" if self._copy_sources.issuperset(self.free) else "free"

    def room_for(self, lane: Lane, lanes: list[Lane]) -> bool:
        """Whether the KV pool has room for one more lane. Unbounded until the pool has refused a
        plan; then no more lanes than it held are admitted, plus one whenever the live lanes'
        cells, what they still have to prefill and ``lane``'s prompt stay under --pressure-low."""
        if self._pool_cap is None or len(lanes) < self._pool_cap:
            return True
        live = max(0, self.used - self.cache.cached_tokens())  # cached prefixes can be evicted
        pending = sum(l.to_feed for l in lanes if l.is_prefilling) + lane.to_feed
        if self.capacity and live + pending <= self.capacity * self.settings.pressure_low:
            self._pool_cap += 1
            if self._pool_cap >= self.settings.max_batch:
                self._pool_cap = None
            return True
        return False

    def waiting_for_shared_prefix(self, queue: list[Lane], donors: list[Lane]) -> set[Lane]:
        """Queued lanes that wait for a prefix one of ``donors`` is still prefilling."""
        return waiting_for_donors(queue, donors) if self.caps.prefix_cache else set()

    def bind(self, lane: Lane, running: list[Lane]) -> int:
        """Give ``lane`` a slot and its seed: its own parked KV, else the longest prefix the cache,
        a running lane or the host tier holds of its prompt. Returns the slot."""
        free = [s for s in self.free if s not in self._copy_sources]
        busy = [l.slot for l in running if l.slot is not None] if self.caps.compact_slots else None
        lane.seed = OWN
        head = 0  # tokens the chosen slot's own cache shares with the prompt, when nothing longer is reused
        if not (may_reuse(lane) and self.caps.prefix_cache):
            slot, reuse = self.cache.best_slot([], free, busy)[0], 0
        else:
            slot, reuse = self._best_seed(lane, free, busy, running)
            if reuse == 0 and lane.seed.own:
                # Too short to be worth a copy, but keeping it in place is free: the slot's cache
                # is cut after the head it shares with the prompt (often a chat template's first
                # tokens), once the whole cache has gone to host memory like any overwritten one.
                head = min(common_prefix(self.cache.tokens(slot), lane.tokens), len(lane.tokens) - 1)
        old = self.cache.tokens(slot)
        if old and (reuse == 0 or not lane.seed.own):
            self._evict_to_host(slot, old, "slot_reuse")  # this slot's cache is about to be overwritten
        reuse = reuse or head
        self.free.remove(slot)
        self.cache.forget(slot)
        lane.n_cached = 0
        if reuse:
            lane.n_cached = reuse
            lane.n_reused += reuse
            self.hits += 1
            self.hit_tokens += reuse
        if lane.parked is not None:  # resume from the parked KV instead of prefilling again
            self._parked.pop(lane.parked, None)
            lane.seed, lane.n_cached = Seed(key=lane.parked), lane.parked_tokens
            lane.parked = None
        if lane.n_cached and self.caps.prefix_cache:  # the slot holds the seed's tokens (a cut or a copy)
            self._held(slot, lane.tokens, lane.n_cached)
        elif old:
            self._report("removed", slot)
        return slot

    def _best_seed(self, lane: Lane, free: list[int], busy: list[int] | None,
                   running: list[Lane]) -> tuple[int, int]:
        """The slot for a lane that may reuse a prefix, and how many tokens its seed holds (the
        seed itself is set on the lane)."""
        slot, reuse = self.cache.best_slot(lane.tokens, free, busy)
        spare = [s for s in free if not self.cache.tokens(s)]
        if reuse and spare and len(self.cache.tokens(slot)) > reuse + MIN_REUSE:
            # The cache holds more than this lane shares (another conversation that branched
            # off here): copy the shared part into an empty slot and keep the cache whole.
            lane.seed = Seed(slot=slot)
            self._copy_sources.add(slot)
            slot = min(spare, key=lambda s: (span(busy, s), -s))
        for donor in running:  # a running lane's KV may hold more of this prompt
            source = kv_source(donor)
            if source is None:
                continue
            shared = min(common_prefix(donor.tokens[:donor.n_cached], lane.tokens), len(lane.tokens) - 1)
            if shared > reuse and shared >= MIN_REUSE:
                reuse, lane.seed = shared, Seed(slot=source)
        if len(self.host):  # a host-memory prefix may hold more of it
            key, shared = self.host.best(lane.tokens)
            if key is not None and shared > reuse and shared >= MIN_REUSE:
                reuse, lane.seed = shared, Seed(key=key, shared=True)
                self.host.touch(key)
        return slot, reuse

    # ---- lanes leaving their slot -----------------------------------------------------------

    def unbind(self, lane: Lane, running: list[Lane]) -> None:
        """A running lane is preempted: undo a seed that never ran, park its KV if allowed, and
        free its slot (cleared: a preempted lane's KV is not a prefix to offer)."""
        slot = lane.slot
        if lane.needs_reset:  # its seed never ran: the slot does not hold its KV yet
            if lane.seed.key is not None and not lane.seed.shared:
                self._drop_parked.append(lane.seed.key)
            elif lane.n_cached:
                lane.n_reused = max(0, lane.n_reused - lane.n_cached)  # the cache hit did not happen
            lane.n_cached = 0
        if self.settings.park and self._host_open() and lane.n_cached > 0:
            key = f"{lane.id}#{lane.preemptions}"
            self._park.append((slot, key))
            self._parked[key] = lane
            lane.parked, lane.parked_tokens = key, lane.n_cached
        for other in running:  # lanes still to copy their seed from this slot prefill instead
            if other is not lane and other.needs_reset and other.seed.slot == slot:
                other.n_reused = max(0, other.n_reused - other.n_cached)
                other.n_cached, other.seed = 0, OWN
                self._report("removed", other.slot)
        lane.n_cached = 0
        lane.seed = OWN
        self.free.append(slot)
        self._release.append(slot)
        self.cache.forget(slot)
        self._report("removed", slot)
        lane.slot = None

    def release(self, lane: Lane, keep_kv: bool) -> None:
        """A lane ended: free its slot. With ``keep_kv`` its KV stays as a cached prefix."""
        self.forget_parked(lane)
        if lane.slot is None:
            return
        self.free.append(lane.slot)
        if keep_kv and self.caps.prefix_cache and not lane.needs_reset:
            tokens = lane.tokens[:lane.n_cached]
            self.cache.store(lane.slot, tokens)
            self._held(lane.slot, tokens, len(tokens))
        else:
            self.cache.forget(lane.slot)
            self._release.append(lane.slot)
            self._report("removed", lane.slot)
        lane.slot = None

    def prefilled(self, lane: Lane) -> None:
        """A running lane's KV grew by prompt tokens: reported as held by its slot, as other
        lanes may already be seeded from it (its generated tokens are reported when it ends)."""
        if self.caps.prefix_cache and lane.slot is not None:
            self._held(lane.slot, lane.tokens, lane.n_cached)

    def forget_parked(self, lane: Lane) -> None:
        if lane.parked is not None:
            self._drop_parked.append(lane.parked)
            self._parked.pop(lane.parked, None)
            lane.parked = None

    def seed_failed(self, lane: Lane, seed: Seed, pos: int) -> None:
        """The engine could not seed ``lane`` from ``seed``: it prefills everything again."""
        if pos and (seed.key is None or seed.shared):  # a cache hit, not its own parked KV
            lane.n_reused = max(0, lane.n_reused - pos)  # it was not reused after all
            log.warning("model %s: cached prefix %s could not seed %s; prefilling", self.name,
                        seed.key or f"of slot {seed.slot if seed.slot is not None else lane.slot}", lane.id)
        if seed.shared:
            self.host.remove(seed.key)
            self._drop_parked.append(seed.key)
        lane.n_cached, lane.needs_reset = 0, True
        if lane.slot is not None:
            self._report("removed", lane.slot)

    # ---- after a tick -----------------------------------------------------------------------

    def tick_done(self, result: TickResult) -> None:
        """Take in what the engine reports: pool numbers, saved artifacts, parked sizes."""
        self.used, self.capacity, self.parked_bytes = result.kv_used, result.kv_capacity, result.parked_bytes
        self.artifacts.tick_done(result)
        for key, size in result.parked.items():
            if self.artifacts.is_temporary(key):
                continue
            lane = self._parked.get(key)
            if lane is None:
                self.host.parked(key, size)
            elif size == 0:  # parking failed: it will prefill again
                self._parked.pop(key)
                lane.parked, lane.parked_tokens = None, 0
        dropped = self.host.trim()
        if dropped:
            self._drop_parked.extend(dropped)
            self._count("host_lru", len(dropped))

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

    def pool_refused(self, refused: int, lanes: list[Lane], progressed: bool) -> PoolVerdict:
        """The engine's KV pool could not hold the plan's next step (``refused`` tokens). Free at
        least the shortfall: cached prefixes first (unpinned least recently used first, pinned
        last); with none left, requeue the newest lanes (they resume from their tokens) and admit
        no more lanes than the pool then holds. After repeated refusals with no progress and
        nothing left to free, the newest lane fails."""
        self.rejections += 1
        self._pool_stuck = 0 if progressed else self._pool_stuck + 1
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
        verdict = PoolVerdict()
        # one lane always stays: the pool holds it alone
        victims = sorted((l for l in lanes if not l.pinned), key=lambda l: l.admitted_at or 0.0)
        victims = victims[-(len(lanes) - 1):] if len(lanes) > 1 else []
        while victims and freed < short:
            lane = victims.pop()  # newest first
            freed += lane.n_cached + (lane.to_feed if lane.is_prefilling else 1)  # its cells and its demand
            log.info("model %s: KV pool full (%d tokens refused): requeueing %s", self.name, refused, lane.id)
            verdict.requeue.append(lane)
        if verdict.requeue:
            self._pool_cap = max(1, len(lanes) - len(verdict.requeue))
        elif self._pool_stuck >= POOL_STUCK_TICKS and lanes:
            verdict.fail = max(lanes, key=lambda l: l.admitted_at or 0.0)
        return verdict

    def pool_progressed(self) -> None:
        self._pool_stuck = 0

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

    # ---- the engine lost its KV -------------------------------------------------------------

    def forget_engine_state(self, queue: list[Lane]) -> None:
        """The engine lost, or may have lost, its KV: forget cached prefixes and parked lanes'
        KV (queued lanes that had parked will prefill again)."""
        self.cache = SlotCache(self.pins)
        self.artifacts.forget()
        self._drop_parked.extend(self.host.clear())
        self.cache_events.append(CacheEvent("cleared", None))
        for lane in queue:
            self.forget_parked(lane)
            lane.parked_tokens = 0

    def engine_restarted(self, lanes: list[Lane]) -> None:
        """A new worker starts empty: nothing to park, drop or release; running lanes prefill
        their tokens again."""
        for lane in lanes:
            lane.n_cached, lane.needs_reset, lane.seed = 0, True, OWN
        self._park.clear()
        self._drop_parked.clear()
        self._release.clear()

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
        key = self.host.add(tokens) if self._host_open() else None
        if key is not None:
            self._park.append((slot, key))
        self._count(reason)

    def _count(self, reason: str, n: int = 1) -> None:
        self.evictions[reason] = self.evictions.get(reason, 0) + n

    def _held(self, slot: int, tokens: list[int], length: int) -> None:
        self.cache_events.append(CacheEvent("stored", "gpu", slot, tokens, length))

    def _report(self, kind: str, slot: int) -> None:
        self.cache_events.append(CacheEvent(kind, "gpu", slot))

    def take_cache_events(self) -> list[CacheEvent]:
        """What the prefix cache stored, removed or cleared since the last call, in order."""
        if not self.cache_events:
            return []
        out = list(self.cache_events)
        self.cache_events.clear()  # the same list: the host tier appends to it
        return out

    def take_counters(self) -> tuple[dict[str, int], int, int, int]:
        """(evictions by reason, cache hits, hit tokens, refused plans) since the last call."""
        out = (self.evictions, self.hits, self.hit_tokens, self.rejections)
        self.evictions, self.hits, self.hit_tokens, self.rejections = {}, 0, 0, 0
        return out
