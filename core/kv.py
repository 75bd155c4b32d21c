"""The KV manager: which slot a lane gets and what seeds it, parking a preempted lane's KV,
releasing an ended lane's slot (its KV kept as a cached prefix or not), and taking in what a tick
reported. The room it keeps (the prefix cache, its host tier, evictions under pressure and the
books of them) is its base, ``core/kv_room.py``.

It answers the scheduler with what it decided (a :class:`Binding`, a :class:`Release`, a
:class:`~superfluid.core.pool_limit.PoolVerdict`) and queues the engine operations those answers
need (park, load, save, drop, release) until the next plan carries them. It never writes a lane
and never calls back into the scheduler: the scheduler applies its answers through the lane's
methods, and preempts or fails the lanes it names. ``core/prefix.py`` holds the data structures
it keeps; ``core/pool_limit.py`` how many lanes the pool holds after it refused a plan; park
artifacts are ``core/artifacts.py``'s.

It also reports what the prefix cache holds as it changes (``core/cache_events.py``)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import attrs

from .artifacts import Artifacts
from .cache_events import CacheEvent
from .kv_room import HOST_PAUSE_S, KVRoom  # noqa: F401  (HOST_PAUSE_S: read from here by tests)
from .lane import Lane
from .prefix import MIN_REUSE, SlotCache
from .seeding import best_seed, may_reuse, own_head, waiting_for_donors
from .tick import OWN, Seed, TickPlan, TickResult

if TYPE_CHECKING:
    from .engine import EngineCapabilities
    from .settings import SchedulerSettings

log = logging.getLogger("superfluid.kv")


@attrs.frozen
class Binding:
    """Where an admitted lane starts (:meth:`KVManager.bind`): its slot, the seed that sets the
    slot up, how many of its tokens that seed holds, and how many of those the prefix cache gave
    (all of them, unless the seed is the lane's own parked KV)."""

    slot: int
    seed: Seed = OWN
    n_cached: int = 0
    reused: int = 0


@attrs.frozen
class Release:
    """What freeing a preempted lane's slot decided (:meth:`KVManager.unbind`): the key its KV is
    parked under and how many tokens that holds (``None``: dropped), the prefix-cache tokens it
    was counted for by a seed that never ran, and the lanes that were to copy their seed from that
    slot, each with the prefix-cache tokens it loses (they prefill instead)."""

    parked: str | None = None
    parked_tokens: int = 0
    not_reused: int = 0
    unseeded: tuple[tuple[Lane, int], ...] = ()


class KVManager(KVRoom):
    def __init__(self, name: str, capabilities: EngineCapabilities, settings: SchedulerSettings):
        super().__init__(name, capabilities, settings)
        # the lanes' slots and the engine's spare ones, where the most recent cached prefixes wait
        self.n_slots = settings.max_batch + capabilities.spare_slots
        self.free = list(range(self.n_slots - 1, -1, -1))
        self._parked: dict[str, Lane] = {}   # park key -> the preempted lane whose KV it holds
        self.artifacts = Artifacts(name)
        self._copy_sources: set[int] = set()  # free slots lanes copy from this tick: keep them whole

    # ---- work for the next tick -------------------------------------------------------------

    def has_work(self) -> bool:
        return bool(self._release or self._drop_parked or self.artifacts.has_work())

    def fill_plan(self, plan: TickPlan) -> None:
        """Add the queued engine operations to ``plan``, in the order the engine applies them."""
        plan.park.extend(self._park)
        self.artifacts.fill_plan(plan, self.free, self.cache, self.host)
        plan.drop_parked.extend(self._drop_parked)
        plan.release.extend(self._release)
        for ops in (self._park, self._drop_parked, self._release):
            ops.clear()
        self._park_tokens = 0

    # ---- admission ----------------------------------------------------------------------------

    def begin_admission(self) -> None:
        self._copy_sources = set()

    @property
    def free_lanes(self) -> int:
        """Lanes that may still be bound: --max-batch less the bound slots (spares never add lanes)."""
        return max(0, self.settings.max_batch - (self.n_slots - len(self.free)))

    def slot_state(self) -> str:
        """"free" when a lane can be bound now, "full" when every lane runs (preempt for it),
        "later" when every free slot is a cache other lanes copy from this tick."""
        if not self.free_lanes:
            return "full"
        return "later" if self._copy_sources.issuperset(self.free) else "free"

    def room_for(self, lane: Lane, lanes: list[Lane]) -> bool:
        """Whether the KV pool has room for one more lane (:meth:`PoolLimit.room_for`)."""
        return self.limit.room_for(lane, lanes, self.used, self.capacity, self.cache)

    def waiting_for_shared_prefix(self, queue: list[Lane], donors: list[Lane]) -> set[Lane]:
        """Queued lanes that wait for a prefix one of ``donors`` is still prefilling."""
        return waiting_for_donors(queue, donors) if self.caps.prefix_cache else set()

    def bind(self, lane: Lane, running: list[Lane]) -> Binding:
        """Choose ``lane``'s slot and its seed: its own parked KV, else the longest prefix the
        cache, a running lane or the host tier holds of its prompt."""
        free = [s for s in self.free if s not in self._copy_sources]
        busy = [l.slot for l in running if l.slot is not None] if self.caps.compact_slots else None
        seed = OWN
        head = 0  # tokens the chosen slot's own cache shares with the prompt, when nothing longer is reused
        if not (may_reuse(lane) and self.caps.prefix_cache):
            slot, reuse = self.cache.best_slot([], free, busy)[0], 0
        else:
            slot, reuse, seed, copied = best_seed(lane, self.cache, self.host, free, busy, running)
            if copied is not None:
                self._copy_sources.add(copied)
            if seed.shared:  # a host-tier prefix: just used
                self.host.touch(seed.key)
                self.host_hits += 1
            if reuse == 0 and seed.own:
                # Too short to be worth a copy, but keeping it in place is free: the slot's cache
                # is cut after the head it shares with the prompt (often a chat template's first
                # tokens), once the whole cache has gone to host memory like any overwritten one.
                head = own_head(self.cache, slot, lane)
        old = self.cache.tokens(slot)
        if old and (reuse == 0 or not seed.own or len(old) > reuse + MIN_REUSE):
            # overwritten, or cut short of the turns of a conversation that branched off: to host first
            self._evict_to_host(slot, old, "slot_reuse")
        reuse = reuse or head
        self.free.remove(slot)
        self.cache.forget(slot)
        if reuse:
            self.hits += 1
            self.hit_tokens += reuse
        binding = Binding(slot, seed, n_cached=reuse, reused=reuse)
        if lane.parked is not None:  # resume from the parked KV instead of prefilling again
            self._parked.pop(lane.parked, None)
            binding = Binding(slot, Seed(key=lane.parked), n_cached=lane.parked_tokens)
        if binding.n_cached and self.caps.prefix_cache:  # the slot holds the seed's tokens (a cut or a copy)
            self._held(slot, lane.tokens, binding.n_cached, lane.request.adapters)
        elif old:
            self._report("removed", slot)
        return binding

    # ---- lanes leaving their slot -----------------------------------------------------------

    def unbind(self, lane: Lane, running: list[Lane]) -> Release:
        """A running lane is preempted: undo a seed that never ran, park its KV if allowed, and
        free its slot (cleared: a preempted lane's KV is not a prefix to offer)."""
        slot, held, not_reused = lane.slot, lane.n_cached, 0
        if lane.needs_reset:  # its seed never ran: the slot does not hold its KV yet
            if lane.seed.key is not None and not lane.seed.shared:
                self._drop_parked.append(lane.seed.key)
            else:
                not_reused = lane.n_cached  # the cache hit did not happen
            held = 0
        parked = None
        if self.settings.park and self._host_open() and held > 0:
            parked = f"{lane.id}#{lane.preemptions}"
            self._park.append((slot, parked))
            self._park_tokens += held
            self._parked[parked] = lane
        unseeded = []
        for other in running:  # lanes still to copy their seed from this slot prefill instead
            if other is not lane and other.needs_reset and other.seed.slot == slot:
                unseeded.append((other, other.n_cached))
                self._report("removed", other.slot)
        self.free.append(slot)
        self._release.append(slot)
        self.cache.forget(slot)
        self._report("removed", slot)
        return Release(parked, held if parked else 0, not_reused, tuple(unseeded))

    def release(self, lane: Lane, keep_kv: bool) -> None:
        """A lane ended: free its slot and drop its parked KV. With ``keep_kv`` its KV stays as a
        cached prefix."""
        self._forget_parked(lane)
        if lane.slot is None:
            return
        self.free.append(lane.slot)
        if keep_kv and self.caps.prefix_cache and not lane.needs_reset:
            tokens = lane.tokens[:lane.n_cached]
            self.cache.store(lane.slot, tokens, lane.request.adapters)  # keyed by its adapter set
            self._held(lane.slot, tokens, len(tokens), lane.request.adapters)
            if self.caps.shared_pool:
                self._bound_shared_cache()
        else:
            self.cache.forget(lane.slot)
            self._release.append(lane.slot)
            self._report("removed", lane.slot)

    def prefilled(self, lane: Lane) -> None:
        """A running lane's KV grew by prompt tokens: reported as held by its slot, as other
        lanes may already be seeded from it (its generated tokens are reported when it ends)."""
        if self.caps.prefix_cache and lane.slot is not None:
            self._held(lane.slot, lane.tokens, lane.n_cached, lane.request.adapters)

    def _forget_parked(self, lane: Lane) -> None:
        if lane.parked is not None:
            self._drop_parked.append(lane.parked)
            self._parked.pop(lane.parked, None)

    def seed_failed(self, lane: Lane, seed: Seed, pos: int) -> int:
        """The engine could not seed ``lane`` from ``seed``: it prefills everything again. Returns
        the prefix-cache tokens counted for it that it did not get after all."""
        not_reused = 0
        if pos and (seed.key is None or seed.shared):  # a cache hit, not its own parked KV
            not_reused = pos
            log.warning("model %s: cached prefix %s could not seed %s; prefilling", self.name,
                        seed.key or f"of slot {seed.slot if seed.slot is not None else lane.slot}", lane.id)
        if seed.shared:
            self.host.remove(seed.key)
            self._drop_parked.append(seed.key)
        if lane.slot is not None:
            self._report("removed", lane.slot)
        return not_reused

    # ---- after a tick -----------------------------------------------------------------------

    def tick_done(self, result: TickResult) -> list[Lane]:
        """Take in what the engine reports: pool numbers, saved artifacts, parked sizes. Returns
        the preempted lanes whose KV could not be parked (they will prefill again)."""
        self.used, self.capacity, self.parked_bytes = result.kv_used, result.kv_capacity, result.parked_bytes
        self.artifacts.tick_done(result)
        unparked = []
        for key, size in result.parked.items():
            if self.artifacts.is_temporary(key):
                continue
            lane = self._parked.get(key)
            if lane is None:
                self.host.parked(key, size)
            elif size == 0:  # parking failed
                self._parked.pop(key)
                unparked.append(lane)
        dropped = self.host.trim()
        if dropped:
            self._drop_parked.extend(dropped)
            self._count("host_lru", len(dropped))
        return unparked

    # ---- the engine lost its KV -------------------------------------------------------------

    def forget_engine_state(self, queue: list[Lane]) -> None:
        """The engine lost, or may have lost, its KV: forget cached prefixes and parked lanes'
        KV (queued lanes that had parked will prefill again: ``Lane.unpark``)."""
        self.cache = SlotCache(self.pins)
        self.artifacts.forget()
        self._drop_parked.extend(self.host.clear())
        self.cache_events.append(CacheEvent("cleared", None))
        for lane in queue:
            self._forget_parked(lane)

    def engine_restarted(self) -> None:
        """A new worker starts empty: nothing to park, drop or release (running lanes prefill
        their tokens again: ``Lane.lose_kv``)."""
        self._park.clear()
        self._drop_parked.clear()
        self._release.clear()
        self._park_tokens = 0

