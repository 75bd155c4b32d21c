"""The scheduler: one thread per model running admit → plan → engine tick → commit.

Nothing else touches lanes. Policies (admission order, victim choice, tick planning) are hooks;
the engine only obeys plans. Front ends talk to it through :meth:`submit` and :meth:`cancel`
from any thread, and hear back through each request's sink."""

from __future__ import annotations

import logging
import threading
import time

import attrs

from .costs import CostModel
from .engine import Engine
from .errors import (ContextLengthExceeded, DeadlineExceeded, EngineCrashed, EngineFailure,
                     ServiceUnavailable, SuperfluidError)
from .lane import Lane, LaneEvent, LaneState
from .prefix import MIN_REUSE, HostTier, SlotCache, common_prefix, span
from .request import Request
from .textstream import TextStream
from .tick import TickPlan, TickResult

log = logging.getLogger("superfluid.scheduler")

MAX_CRASHES = 5            # engine crashes within CRASH_WINDOW_S before a model is given up
CRASH_WINDOW_S = 60.0
PRESSURE_CHECK_S = 0.5     # how often OS pressure sources are read
HOST_PAUSE_S = 30.0        # after OS pressure, nothing moves to host memory for this long
ARRIVAL_WINDOW_S = 0.010  # longest wait for a burst to arrive when the scheduler wakes from idle
ARRIVAL_QUIET_S = 0.003   # a gap this long without a new request ends the wait


@attrs.define
class SchedulerSettings:
    """A model's scheduling knobs (from config) plus what its engine declared."""

    max_batch: int = 8
    context_length: int = 4096
    prefill_budget: int = 4096
    tick_decode_budget: int = 0
    tick_target_ms: int = 2000
    starvation_ticks: int = 8
    extra: dict = attrs.field(factory=dict)  # plugin-declared, model-scoped options


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
    cache_hits: int = 0         # lanes seeded from the prefix cache (or a running lane) while planning
    cache_hit_tokens: int = 0   # prompt tokens those lanes did not have to prefill
    cached_tokens: int = 0      # tokens held as cached prefixes in free slots
    evictions: dict = attrs.field(factory=dict)  # cached prefixes evicted, by reason
    host_entries: int = 0       # prefixes held in host memory
    host_bytes: int = 0
    pressure: str = "ok"        # the worst level the pressure sources reported
    pool_rejections: int = 0    # plans the KV pool could not hold (freed room and retried)


class Scheduler:
    def __init__(self, name: str, engine: Engine, hook, settings: SchedulerSettings,
                 pressure_sources: list | None = None):
        self.name = name
        self.engine = engine
        self.hook = hook
        self.settings = settings
        self.costs = CostModel()
        self.queue: list[Lane] = []
        self.lanes: list[Lane] = []
        self._free_slots = list(range(settings.max_batch - 1, -1, -1))
        self._release: list[int] = []
        self._park: list[tuple[int, str]] = []
        self._drop_parked: list[str] = []
        self._parked: dict[str, Lane] = {}
        self._preempted = 0
        self._arrivals = 0
        self._crashes: list[float] = []
        self._pins = list(settings.extra.get("pinned-tokens") or [])
        self.cache = SlotCache(self._pins)
        self.host = HostTier(settings.extra.get("host-cache-mb", 0) << 20)
        self.pressure_sources = list(pressure_sources or [])
        self.pressure = "ok"
        self._pressure_checked = 0.0
        self._host_paused_until = 0.0
        self._evictions: dict[str, int] = {}
        self._hits = 0
        self._hit_tokens = 0
        self._promoted = 0
        self._saves: list[_SaveOp] = []   # park artifacts to write at the next tick
        self._loads: list[tuple[str, list[int]]] = []  # park artifacts to read at the next tick
        self._saving: dict[str, _SaveOp] = {}
        self._save_keys: set[str] = set()  # park keys that exist only for a save in the same tick
        self._staged_loads: list[tuple[str, str]] = []
        self._copy_sources: set[int] = set()
        self._pool_cap: int | None = None  # after the KV pool refused a plan: most lanes it holds for now
        self._pool_stuck = 0    # ticks in a row the pool refused without any progress
        self._rejections = 0    # refused plans since the last stats
        self._close_reason, self._close_code = f"model {name!r} is shutting down", "shutting_down"
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._aborted = False
        self.ticks = 0
        self._quiet_tick = False  # the tick in flight is a quiet one (TickPlan.quiet)
        self.kv = (0, 0)
        self.parked_bytes = 0

    # ---- front-end side (any thread) ---------------------------------------------------------

    def submit(self, request: Request) -> Lane:
        """Queue a request. Raises if it can never run (prompt longer than the context)."""
        n = len(request.prompt_tokens)
        ctx = self.settings.context_length
        if n == 0:
            raise SuperfluidError("the prompt is empty", status=400, code="invalid_prompt")
        if n >= ctx:
            raise ContextLengthExceeded(
                f"This model's maximum context length is {ctx} tokens, but the prompt has {n} tokens.",
                param="messages" if request.meta.get("chat") else "prompt")
        lane = Lane(request=request, text=TextStream(self.engine.token_bytes, request.stop))
        with self._cv:
            if self._closed:
                raise self._closed_error()
            self.queue.append(lane)
            self._arrivals += 1
            self._cv.notify()
            if self.lanes and self.hook.superfluid_should_stop_tick(lane=lane, lanes=list(self.lanes),
                                                                    settings=self.settings):
                self.engine.request_stop()
            elif self._quiet_tick:  # it promised to yield to a newcomer
                self.engine.request_yield()
        return lane

    def cancel(self, request_id: str) -> None:
        """Cancel a request wherever it is; a running tick ends at the engine's next step."""
        with self._cv:
            for lane in self.queue:
                if lane.id == request_id:
                    self.queue.remove(lane)
                    self._finish(lane, "cancelled", LaneState.CANCELLED)
                    return
            for lane in self.lanes:
                if lane.id == request_id and not lane.cancel_requested:
                    lane.cancel_requested = True
                    self.engine.request_stop()
                    self._cv.notify()
                    return

    def save_prefix(self, tokens: list[int], path: str, timeout: float = 60.0) -> list[int] | None:
        """Write the cached KV that best covers ``tokens`` to a park artifact at ``path`` (a
        session's KV, outliving this process). Returns the tokens the artifact holds, or None when
        nothing of them is cached or the engine cannot persist KV. Blocks until the next tick."""
        if not self.engine.capabilities.persists_kv:
            return None
        op = _SaveOp(tokens=list(tokens), path=path)
        with self._cv:
            if self._closed and self._thread is not None and not self._thread.is_alive():
                return None
            self._saves.append(op)
            self._cv.notify()
        if not op.done.wait(timeout):
            return None
        return op.saved

    def pin_prefix(self, tokens: list[int], pin: bool = True) -> None:
        """Pin (or, with ``pin`` false, unpin) a prompt prefix at runtime: cached KV starting
        with it is evicted last, like --pin-prompt's."""
        tokens = list(tokens)
        with self._cv:
            if pin:
                self._pins.append(tokens)
                self.cache.pin(tokens)
            else:
                if tokens in self._pins:
                    self._pins.remove(tokens)
                self.cache.unpin(tokens)

    def adopt_prefix(self, tokens: list[int], path: str) -> bool:
        """Load a park artifact holding ``tokens`` into the host tier at the next tick, so the next
        request that starts with them restores instead of prefilling. False if unsupported."""
        if not (self.engine.capabilities.persists_kv and self.engine.capabilities.prefix_cache):
            return False
        with self._cv:
            self._loads.append((path, list(tokens)))
            self._cv.notify()
        return True

    def snapshot(self) -> dict:
        """Per-slot state for /slots."""
        now = time.monotonic()
        with self._cv:
            by_slot = {lane.slot: lane for lane in self.lanes}
            slots = []
            for slot in range(self.settings.max_batch):
                lane = by_slot.get(slot)
                if lane is None:
                    slots.append({"id": slot, "state": "free", "cached_tokens": len(self.cache.tokens(slot))})
                    continue
                slots.append(_lane_view(slot, lane, now))
            return {"model": self.name, "slots": slots, "queued": len(self.queue),
                    "queue": [{"request_id": l.id, "qos": l.qos, "waited_s": round(now - l.queued_at, 3),
                               "parked": l.parked is not None} for l in self.queue],
                    "ticks": self.ticks, "kv_used": self.kv[0], "kv_capacity": self.kv[1],
                    "kv_cached": self.cache.cached_tokens(),
                    "pinned_prefixes": len(self._pins),  # --pin-prompt's and open sessions' system prompts
                    "parked_bytes": max(0, self.parked_bytes - self.host.bytes),  # by preempted lanes
                    "host_cache_bytes": self.host.bytes,
                    "costs": self.costs.as_dict()}

    # ---- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=f"scheduler-{self.name}", daemon=True)
        self._thread.start()

    def close(self, timeout: float = 10.0, reason: str | None = None, code: str = "shutting_down") -> None:
        """Stop admitting; let running lanes finish for up to ``timeout`` s, then fail them
        (503 with ``reason`` and ``code``)."""
        self._close_reason = reason or f"model {self.name!r} is shutting down"
        self._close_code = code
        with self._cv:
            self._closed = True
            for lane in list(self.queue):
                self._fail(lane, self._closed_error())
            self.queue.clear()
            self._cv.notify_all()
        if self._thread is None:
            return
        self._thread.join(timeout)
        if self._thread.is_alive():
            with self._cv:
                self._aborted = True
                self._cv.notify_all()
            self.engine.request_stop()
            self._thread.join(10)

    def _closed_error(self) -> ServiceUnavailable:
        return ServiceUnavailable(self._close_reason, code=self._close_code, headers={"Retry-After": "5"})

    def busy(self) -> bool:
        with self._cv:
            return bool(self.queue or self.lanes)

    # ---- the loop (scheduler thread) -----------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cv:
                while not (self._closed or self.queue or self.lanes or self._release or self._saves
                           or self._loads or self._drop_parked):
                    self._cv.wait()
                if self._closed and not (self.lanes or self._saves):
                    break
                if not self.lanes:
                    self._gather_arrivals()
                self.engine.clear_stop()
                self._quiet_tick = False
                try:
                    plan = self._plan()
                except Exception as exc:  # a policy hook failed: fail what it touched, keep the thread
                    log.exception("model %s: planning failed", self.name)
                    self._policy_failed(exc)
                    continue
                if plan.empty():  # nothing runnable now (e.g. every queued class at its cap)
                    self._cv.wait(0.05)
                    continue
                self._quiet_tick = plan.quiet
            try:
                result = self.engine.run_tick(plan)
            except EngineCrashed as exc:  # the worker died: restart it, lanes resume from their tokens
                log.error("model %s: %s", self.name, exc)
                self._recover(exc)
                continue
            except Exception as exc:  # the engine failed: fail its lanes, keep serving others
                log.exception("model %s: tick failed", self.name)
                with self._cv:
                    self._engine_failed(exc)
                continue
            with self._cv:
                self._quiet_tick = False
                stats = self._commit(plan, result)
            self.hook.superfluid_tick_done(model=self.name, stats=stats)
        log.info("model %s: scheduler stopped", self.name)

    def _gather_arrivals(self) -> None:
        """Waking from idle, wait a moment for requests sent together to arrive together, so their
        prefills share the first tick instead of queueing behind one another's (a burst's requests
        reach the scheduler a few ms apart). Costs a lone request at most ARRIVAL_WINDOW_S."""
        deadline = time.monotonic() + ARRIVAL_WINDOW_S
        seen = self._arrivals
        while not self._closed and not any(l.request.start_deadline for l in self.queue):
            left = deadline - time.monotonic()
            if left <= 0:
                return
            self._cv.wait(min(ARRIVAL_QUIET_S, left))
            if self._arrivals == seen:  # quiet for a moment: the burst is in
                return
            seen = self._arrivals

    def _plan(self) -> TickPlan:
        now = time.monotonic()
        for lane in [l for l in self.lanes if l.cancel_requested]:
            self._finish(lane, "cancelled", LaneState.CANCELLED)
        self._stage_loads()
        if self._aborted:
            for lane in list(self.lanes):
                self._fail(lane, self._closed_error())
        elif not self._closed:
            self._admit(now)
        for lane in self.queue:
            lane.waited_ticks += 1
        plan = TickPlan()
        if self.lanes:
            plan = self.hook.superfluid_plan_tick(
                lanes=list(self.lanes), queue=list(self.queue), costs=self.costs,
                capabilities=self.engine.capabilities, settings=self.settings, now=now)
            if plan is None:
                raise RuntimeError("no plugin implements superfluid_plan_tick (is the qos plugin installed?)")
        planned = {lp.slot for lp in plan.lanes}
        for lane in self.lanes:  # admitted lanes left without prefill age toward starvation too
            if lane.is_prefilling:
                lane.waited_ticks = 0 if lane.slot in planned else lane.waited_ticks + 1
        plan.park.extend(self._park)
        self._plan_artifacts(plan)
        plan.drop_parked.extend(self._drop_parked)
        plan.release.extend(self._release)
        self._park.clear()
        self._drop_parked.clear()
        self._release.clear()
        return plan

    def _plan_artifacts(self, plan: TickPlan) -> None:
        """Park artifacts: a save copies the best cached slot (or host prefix) for its tokens to a
        file; a load brings a file into the host tier under a fresh key."""
        for op in self._saves:
            cached = [s for s in self._free_slots if self.cache.tokens(s)]
            slot, n = self.cache.best_slot(op.tokens + [-1], cached) if cached else (None, 0)
            key, host_n = self.host.best(op.tokens + [-1]) if len(self.host) else (None, 0)
            if key is not None and host_n > n:
                op.saved = self.host.tokens(key)
                plan.save.append((key, op.path))
            elif n >= MIN_REUSE:
                op.saved = list(self.cache.tokens(slot))
                tmp = f"save:{op.path}"
                self._save_keys.add(tmp)
                plan.park.append((slot, tmp))
                plan.save.append((tmp, op.path))
                plan.drop_parked.append(tmp)
            else:
                op.done.set()
                continue
            self._saving[op.path] = op
        self._saves.clear()
        plan.load.extend(self._staged_loads)
        self._staged_loads.clear()

    def _stage_loads(self) -> None:
        """Park artifacts to load enter the host tier before admission, so the lanes admitted in
        the same plan already restore from them (the engine loads before it seeds lanes)."""
        for path, tokens in self._loads:
            self._staged_loads.append((path, self.host.add(tokens, force=True)))
        self._loads.clear()

    def _admit(self, now: float) -> None:
        """Fill free lanes in policy order; with none free, let the policy preempt for a queued lane."""
        self._copy_sources = set()  # free slots lanes copy from this tick: not to be overwritten in it
        self._expire(now)
        waiting = self._waiting_for_shared_prefix(self.lanes) if self._free_slots else set()
        while self.queue:
            candidates = [l for l in self.queue if l not in waiting
                          and not (self.pressure == "critical" and l.qos == "background")]
            if not candidates:
                return
            lane = self.hook.superfluid_pick_next(queue=candidates, lanes=list(self.lanes),
                                                  now=now, settings=self.settings)
            if lane is None:
                return
            if self._free_slots and self._copy_sources.issuperset(self._free_slots):
                return  # every free slot is a cache other lanes copy from this tick: next tick
            if not self._free_slots or not self._pool_room(lane):
                victim = self.hook.superfluid_choose_victim(lane=lane, lanes=list(self.lanes),
                                                            settings=self.settings)
                if victim is None or victim not in self.lanes or victim.pinned:
                    return
                self._preempt(victim)
            self._bind(lane, now)
            waiting |= self._waiting_for_shared_prefix([lane])

    def _pool_room(self, lane: Lane) -> bool:
        """Whether the KV pool has room for one more lane. Unbounded until the pool has refused a
        plan; then no more lanes than it held are admitted, plus one whenever the live lanes'
        cells, what they still have to prefill and ``lane``'s prompt stay under --pressure-low."""
        if self._pool_cap is None or len(self.lanes) < self._pool_cap:
            return True
        used, capacity = self.kv
        live = max(0, used - self.cache.cached_tokens())  # cached prefixes can be evicted
        pending = sum(l.to_feed for l in self.lanes if l.is_prefilling) + lane.to_feed
        if capacity and live + pending <= capacity * self.settings.extra.get("pressure-low", 0.70):
            self._pool_cap += 1
            if self._pool_cap >= self.settings.max_batch:
                self._pool_cap = None
            return True
        return False

    def _waiting_for_shared_prefix(self, lanes: list[Lane]) -> set[Lane]:
        """Queued lanes whose prompt starts with a prefix one of ``lanes`` is still prefilling:
        they wait for it and copy it, instead of prefilling the same tokens again."""
        if not self.engine.capabilities.prefix_cache:
            return set()
        donors = [l for l in lanes if l.is_prefilling and l.n_cached < l.n_prompt]
        waiting = set()
        for lane in self.queue if donors else ():
            if lane.parked is not None or not lane.request.reuse_prefix:
                continue
            head = lane.tokens[:MIN_REUSE]
            for donor in donors:
                if donor.tokens[:MIN_REUSE] != head:  # cheap reject before the full comparison
                    continue
                shared = min(common_prefix(donor.tokens[:donor.n_prompt], lane.tokens), lane.n_prompt - 1)
                if shared >= MIN_REUSE and donor.n_cached < shared:
                    waiting.add(lane)
                    break
        return waiting

    def _seed(self, lane: Lane) -> int:
        """Pick the lane's slot and seed it from the prefix cache or a running lane; the slot."""
        free = [s for s in self._free_slots if s not in self._copy_sources]
        busy = [l.slot for l in self.lanes if l.slot is not None] if self.engine.capabilities.compact_slots else None
        head = 0  # tokens the chosen slot's own cache shares with the prompt, when nothing longer is reused
        if (lane.parked is not None or not self.engine.capabilities.prefix_cache
                or not lane.request.reuse_prefix):
            slot, reuse = self.cache.best_slot([], free, busy)[0], 0
        else:
            slot, reuse = self.cache.best_slot(lane.tokens, free, busy)
            spare = [s for s in free if not self.cache.tokens(s)]
            if reuse and spare and len(self.cache.tokens(slot)) > reuse + MIN_REUSE:
                # The cache holds more than this lane shares (another conversation that branched
                # off here): copy the shared part into an empty slot and keep the cache whole.
                lane.copy_from = slot
                self._copy_sources.add(slot)
                slot = min(spare, key=lambda s: (span(busy, s), -s))
            for donor in self.lanes:  # a running lane's KV may hold more of this prompt
                source = _kv_source(donor)
                if source is None:
                    continue
                shared = min(common_prefix(donor.tokens[:donor.n_cached], lane.tokens), len(lane.tokens) - 1)
                if shared > reuse and shared >= MIN_REUSE:
                    reuse, lane.copy_from = shared, source
            if lane.copy_from is not None and reuse < MIN_REUSE:
                lane.copy_from = None
            if len(self.host):  # a host-memory prefix may hold more of it
                key, shared = self.host.best(lane.tokens)
                if key is not None and shared > reuse and shared >= MIN_REUSE:
                    reuse, lane.restore_prefix, lane.copy_from = shared, key, None
                    self.host.touch(key)
            if reuse == 0 and lane.copy_from is None and lane.restore_prefix is None:
                # Too short to be worth a copy, but keeping it in place is free: the slot's cache
                # is cut after the head it shares with the prompt (often a chat template's first
                # tokens), once the whole cache has gone to host memory like any overwritten one.
                head = min(common_prefix(self.cache.tokens(slot), lane.tokens), len(lane.tokens) - 1)
        old = self.cache.tokens(slot)
        if old and (reuse == 0 or lane.copy_from is not None or lane.restore_prefix is not None):
            self._evict_to_host(slot, old, "slot_reuse")  # this slot's cache is about to be overwritten
        reuse = reuse or head
        self._free_slots.remove(slot)
        self.cache.forget(slot)
        if reuse:
            lane.n_cached = reuse
            lane.n_reused += reuse
            self._hits += 1
            self._hit_tokens += reuse
        return slot

    def _host_open(self) -> bool:
        """Nothing moves to host memory for a while after OS memory pressure."""
        return self.engine.capabilities.supports_parking and time.monotonic() >= self._host_paused_until

    def _evict_to_host(self, slot: int, tokens: list[int], reason: str) -> None:
        """Move a free slot's cached prefix to the host tier (or just let it go)."""
        key = self.host.add(tokens) if self._host_open() else None
        if key is not None:
            self._park.append((slot, key))
        self._evictions[reason] = self._evictions.get(reason, 0) + 1

    def _relieve_pressure(self, used: int, capacity: int) -> None:
        """Watermarks: at --pressure-high occupancy evict cached prefixes (least recently used
        first) down to --pressure-low. Live lanes are never evicted."""
        high, low = self.settings.extra.get("pressure-high", 0.85), self.settings.extra.get("pressure-low", 0.70)
        if not capacity or used / capacity < high:
            return
        for slot in self.cache.lru_slots():
            if used / capacity <= low:
                break
            tokens = self.cache.tokens(slot)
            self._evict_to_host(slot, tokens, "watermark")
            self.cache.forget(slot)
            self._release.append(slot)
            used -= len(tokens)

    def _pool_refused(self, refused: int, used: int, capacity: int, progressed: bool) -> None:
        """Replan: the engine's KV pool (``used`` of ``capacity`` cells) could not hold the plan's
        next step (``refused`` tokens). Free at least the shortfall: cached prefixes first
        (unpinned least recently used first, pinned last); with none left, requeue the newest
        lanes (never failed: they resume from their tokens) and admit no more lanes than the pool
        now holds. The next tick plans what was left undone."""
        self._rejections += 1
        self._pool_stuck = 0 if progressed else self._pool_stuck + 1
        short = max(1, refused - max(0, capacity - used))
        freed = 0
        for slot in self.cache.lru_slots():
            if freed >= short:
                break
            tokens = self.cache.tokens(slot)
            self._evict_to_host(slot, tokens, "pool_full")
            self.cache.forget(slot)
            self._release.append(slot)
            freed += len(tokens)
        if freed:
            log.info("model %s: KV pool full (%d tokens refused): evicted %d cached tokens",
                     self.name, refused, freed)
            return
        victims = sorted((l for l in self.lanes if not l.pinned), key=lambda l: l.admitted_at or 0.0)
        if len(self.lanes) > 1:
            victims = victims[-(len(self.lanes) - 1):]  # one lane always stays: the pool holds it alone
        else:
            victims = []
        while victims and freed < short:
            lane = victims.pop()  # newest first
            freed += lane.n_cached + (lane.to_feed if lane.is_prefilling else 1)  # its cells and its demand
            log.info("model %s: KV pool full (%d tokens refused): requeueing %s", self.name, refused, lane.id)
            self._preempt(lane)
        if freed:
            self._pool_cap = max(1, len(self.lanes))
        elif self._pool_stuck >= 3 and self.lanes:  # nothing left to free, no progress: give up the newest
            lane = max(self.lanes, key=lambda l: l.admitted_at or 0.0)
            self._fail(lane, EngineFailure(f"model {self.name!r}: the KV pool cannot hold this request"))

    def _check_pressure(self, now: float) -> None:
        """OS pressure: a warning runs one eviction round, critical also preempts every decoding
        background lane. Either drops the host-memory prefixes first and keeps the host tier
        closed for a while."""
        if not self.pressure_sources or now - self._pressure_checked < PRESSURE_CHECK_S:
            return
        self._pressure_checked = now
        levels = []
        for source in self.pressure_sources:
            try:
                levels.append(source.level())
            except Exception:  # a broken source must not stop the model
                log.exception("model %s: pressure source %r failed", self.name, source)
        self.pressure = "critical" if "critical" in levels else "warning" if "warning" in levels else "ok"
        if self.pressure == "ok":
            return
        log.warning("model %s: OS memory pressure %s: evicting cached prefixes", self.name, self.pressure)
        self._host_paused_until = now + HOST_PAUSE_S
        dropped = self.host.clear()
        self._drop_parked.extend(dropped)
        if dropped:
            self._evictions["host_os_pressure"] = self._evictions.get("host_os_pressure", 0) + len(dropped)
        slots = self.cache.lru_slots()
        unpinned = [s for s in slots if not self.cache.pinned(s)]
        if self.pressure == "warning" and unpinned:  # pinned prefixes yield only when nothing else is left
            slots = unpinned
        for slot in slots:
            self.cache.forget(slot)
            self._release.append(slot)
        if slots:
            self._evictions["os_pressure"] = self._evictions.get("os_pressure", 0) + len(slots)
        if self.pressure == "critical":
            for lane in [l for l in self.lanes if l.qos == "background" and not l.is_prefilling
                         and not l.pinned]:
                self._preempt(lane)

    def _bind(self, lane: Lane, now: float) -> None:
        self.queue.remove(lane)
        lane.slot = self._seed(lane)
        lane.state = LaneState.PREFILLING
        lane.needs_reset = True
        if lane.waited_ticks >= self.settings.starvation_ticks:
            self._promoted += 1
        lane.waited_ticks = 0
        if lane.parked is not None:  # resume from the parked KV instead of prefilling again
            self._parked.pop(lane.parked, None)
            lane.restore, lane.n_cached = lane.parked, lane.parked_tokens
            lane.parked = None
        self.lanes.append(lane)
        if lane.admitted_at is None:
            lane.admitted_at = now
            self._emit(lane, LaneEvent("admitted", lane.id, timings={"queued_s": now - lane.queued_at}))
        else:
            self._emit(lane, LaneEvent("resumed", lane.id))

    def _preempt(self, lane: Lane) -> None:
        """Stop a running lane and requeue it at the head of its class; park its KV if allowed."""
        slot = lane.slot
        if lane.needs_reset:  # its seed never ran: the slot does not hold its KV yet
            if lane.restore is not None:
                self._drop_parked.append(lane.restore)
            elif lane.n_cached:
                lane.n_reused = max(0, lane.n_reused - lane.n_cached)  # the cache hit did not happen
            lane.n_cached = 0
            lane.restore = lane.restore_prefix = None
        if self.settings.extra.get("park") and self._host_open() and lane.n_cached > 0:
            key = f"{lane.id}#{lane.preemptions}"
            self._park.append((slot, key))
            self._parked[key] = lane
            lane.parked, lane.parked_tokens = key, lane.n_cached
        for other in self.lanes:  # lanes still to copy their seed from this slot prefill instead
            if other is not lane and other.needs_reset and other.copy_from == slot:
                other.n_reused = max(0, other.n_reused - other.n_cached)
                other.n_cached, other.copy_from = 0, None
        lane.n_cached = 0
        lane.restore = None
        lane.preemptions += 1
        lane.state = LaneState.PREEMPTED
        lane.waited_ticks = 0
        self.lanes.remove(lane)
        self._free_slots.append(slot)
        self._release.append(slot)
        self.cache.forget(slot)
        lane.slot = None
        lane.copy_from = None
        self.queue.insert(0, lane)
        self._preempted += 1
        log.info("model %s: preempted %s (%s)%s", self.name, lane.id, lane.qos,
                 " parking its KV" if lane.parked else "")
        self._emit(lane, LaneEvent("paused", lane.id))

    def _expire(self, now: float) -> None:
        for lane in [l for l in self.queue if l.request.start_deadline is not None
                     and l.admitted_at is None and now > l.request.start_deadline]:
            self.queue.remove(lane)
            self._fail(lane, DeadlineExceeded(
                "the request could not start before its deadline (--completion-deadline-ms); retry later",
                headers={"Retry-After": "1"}))

    def _forget_parked(self, lane: Lane) -> None:
        if lane.parked is not None:
            self._drop_parked.append(lane.parked)
            self._parked.pop(lane.parked, None)
            lane.parked = None

    def _commit(self, plan: TickPlan, result: TickResult) -> TickStats:
        self.ticks += 1
        self.costs.observe(result.steps)
        self.kv = (result.kv_used, result.kv_capacity)
        self.parked_bytes = result.parked_bytes
        by_slot = {lane.slot: lane for lane in self.lanes}
        now = time.monotonic()
        first_tokens: list[tuple[str, float]] = []
        finished: list[Lane] = []
        decode_tokens = 0
        prefilled = 0
        for lp in plan.lanes:
            lane = by_slot.get(lp.slot)
            if lane is None:
                continue
            lane.needs_reset = False
            lane.restore = None
            lane.copy_from = None
            prefix_key, lane.restore_prefix = lane.restore_prefix, None
            res = result.lanes.get(lp.slot)
            if res is None:
                continue
            if res.restore_failed:  # the seed was lost or unusable: prefill everything again
                if lp.pos and (lp.restore is None or lp.keep_parked):  # a cache hit, not its own parked KV
                    lane.n_reused = max(0, lane.n_reused - lp.pos)  # it was not reused after all
                    log.warning("model %s: cached prefix %s could not seed %s; prefilling", self.name,
                                prefix_key or f"of slot {lp.copy_from if lp.copy_from is not None else lp.slot}",
                                lane.id)
                if prefix_key is not None:
                    self.host.remove(prefix_key)
                    self._drop_parked.append(prefix_key)
                lane.n_cached, lane.needs_reset = 0, True
                continue
            lane.n_cached += res.n_fed
            lane.n_prefilled += res.n_prefill
            prefilled += res.n_prefill
            decode_tokens += len(res.tokens)
            if self._take_tokens(lane, res.tokens, res.eog, now, first_tokens):
                finished.append(lane)
            elif lane.active:
                lane.state = LaneState.PREFILLING if lane.is_prefilling else LaneState.DECODING
        for lane in [l for l in self.lanes if l.cancel_requested]:
            self._finish(lane, "cancelled", LaneState.CANCELLED)
            finished.append(lane)
        for path, size in result.saved.items():
            op = self._saving.pop(path, None)
            if op is not None:
                if size <= 0:
                    op.saved = None
                    log.warning("model %s: could not write park artifact %s", self.name, path)
                op.done.set()
        for key, size in result.parked.items():
            if key in self._save_keys:  # parked only to be written to a file, then dropped
                self._save_keys.discard(key)
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
            self._evictions["host_lru"] = self._evictions.get("host_lru", 0) + len(dropped)
        self._check_pressure(now)  # first: under OS pressure nothing may move to host memory
        if result.rejected_tokens:
            self._pool_refused(result.rejected_tokens, result.kv_used, result.kv_capacity,
                               progressed=bool(prefilled or decode_tokens))
        else:
            self._pool_stuck = 0
        self._relieve_pressure(result.kv_used, result.kv_capacity)
        rejections, self._rejections = self._rejections, 0
        evictions, self._evictions = self._evictions, {}
        preempted, promoted, hits, hit_tokens = self._preempted, self._promoted, self._hits, self._hit_tokens
        self._preempted = self._promoted = self._hits = self._hit_tokens = 0
        return TickStats(
            model=self.name, seconds=result.seconds, prefill_tokens=prefilled,
            decode_tokens=decode_tokens, prefill_budget=plan.prefill_budget,
            decode_grant=plan.decode_grant, lanes_busy=len(self.lanes),
            max_lanes=self.settings.max_batch, queue_depth=len(self.queue),
            stopped_early=result.stopped_early, quiet=plan.quiet, kv_used=result.kv_used,
            kv_capacity=result.kv_capacity, first_tokens=first_tokens, finished=finished,
            queue_by_class=_count_by_class(self.queue), lanes_by_class=_count_by_class(self.lanes),
            preempted=preempted, promoted=promoted, parked_bytes=result.parked_bytes,
            cache_hits=hits, cache_hit_tokens=hit_tokens, cached_tokens=self.cache.cached_tokens(),
            evictions=evictions, host_entries=len(self.host), host_bytes=self.host.bytes,
            pressure=self.pressure, pool_rejections=rejections)

    def _take_tokens(self, lane: Lane, tokens: list[int], eog: bool, now: float,
                     first_tokens: list) -> bool:
        """Append sampled tokens to a lane and stream their text; True if the lane finished."""
        if not tokens:
            return False
        if lane.first_token_at is None:
            lane.first_token_at = now
            first_tokens.append((lane.qos, now - lane.admitted_at))
        text = []
        used = []
        reason = None
        for i, token in enumerate(tokens):
            lane.tokens.append(token)
            if eog and i == len(tokens) - 1 and not lane.request.ignore_eos:
                reason = "stop"
                break
            lane.n_output += 1
            used.append(token)
            text.append(lane.text.push(token))
            if lane.text.stopped:
                reason = "stop"
                break
            if lane.remaining_tokens <= 0 or len(lane.tokens) >= self.settings.context_length:
                reason = "length"
                break
        delta = "".join(text)
        if delta or used:
            self._emit(lane, LaneEvent("delta", lane.id, text=delta, token_ids=tuple(used)))
        if reason is not None:
            self._finish(lane, reason, LaneState.FINISHED)
            return True
        return False

    def _finish(self, lane: Lane, reason: str, state: LaneState) -> None:
        tail = lane.text.flush() if reason != "cancelled" else ""
        if tail:
            self._emit(lane, LaneEvent("delta", lane.id, text=tail))
        lane.state = state
        lane.finish_reason = reason
        lane.finished_at = time.monotonic()
        self._drop(lane, keep_kv=True)
        self._emit(lane, LaneEvent("finished", lane.id, finish_reason=reason,
                                   prompt_tokens=lane.n_prompt, completion_tokens=lane.n_output,
                                   cached_tokens=min(lane.n_reused, lane.n_prompt),
                                   timings=_timings(lane)))
        self.hook.superfluid_lane_finished(model=self.name, lane=lane)

    def _fail(self, lane: Lane, exc: BaseException) -> None:
        lane.state = LaneState.FINISHED
        lane.finish_reason = "error"
        lane.finished_at = time.monotonic()
        self._drop(lane)
        self._emit(lane, LaneEvent("error", lane.id, error=exc, timings=_timings(lane)))
        self.hook.superfluid_lane_finished(model=self.name, lane=lane)

    def _drop(self, lane: Lane, keep_kv: bool = False) -> None:
        """Free the lane's slot. With ``keep_kv`` its KV stays as a cached prefix for later lanes."""
        self._forget_parked(lane)
        if lane in self.lanes:
            self.lanes.remove(lane)
        if lane.slot is not None:
            self._free_slots.append(lane.slot)
            if keep_kv and self.engine.capabilities.prefix_cache and not lane.needs_reset:
                self.cache.store(lane.slot, lane.tokens[:lane.n_cached])
            else:
                self.cache.forget(lane.slot)
                self._release.append(lane.slot)
            lane.slot = None

    def _policy_failed(self, exc: Exception) -> None:
        error = EngineFailure(f"scheduling policy failed: {exc}")
        for lane in list(self.lanes) + list(self.queue):
            if lane in self.queue:
                self.queue.remove(lane)
            self._fail(lane, error)

    def _recover(self, exc: Exception) -> None:
        """Restart a crashed engine and resume every lane from its prompt + generated tokens, so
        clients see a pause, not repeated or lost text. Repeated crashes back off, then fail."""
        now = time.monotonic()
        self._crashes = [t for t in self._crashes if now - t < CRASH_WINDOW_S] + [now]
        with self._cv:
            self._forget_engine_state()
            for lane in self.lanes:
                lane.n_cached, lane.needs_reset = 0, True
                lane.copy_from = lane.restore = lane.restore_prefix = None
            self._park.clear()  # the new worker starts empty: nothing to park, drop or release
            self._drop_parked.clear()
            self._release.clear()
        if len(self._crashes) > MAX_CRASHES:
            with self._cv:
                self._engine_failed(EngineFailure(
                    f"model {self.name!r}: engine crashed {len(self._crashes)} times in "
                    f"{CRASH_WINDOW_S:.0f} s; not restarting ({exc})"))
                for lane in list(self.queue):
                    self.queue.remove(lane)
                    self._fail(lane, EngineFailure(f"model {self.name!r} is down: its engine keeps crashing"))
                self._closed = True
            return
        time.sleep(min(2 ** (len(self._crashes) - 1) * 0.5, 8.0))  # back off before restarting
        try:
            self.engine.restart()
            log.warning("model %s: engine restarted; %d lanes resume", self.name, len(self.lanes))
        except Exception as restart_exc:  # noqa: BLE001 - reported to the lanes
            log.exception("model %s: restart failed", self.name)
            with self._cv:
                self._engine_failed(EngineFailure(f"model {self.name!r}: restart failed: {restart_exc}"))

    def _forget_engine_state(self) -> None:
        """The engine lost, or may have lost, its KV: forget cached prefixes and parked lanes'
        KV (queued lanes that had parked will prefill again)."""
        self.cache = SlotCache(self._pins)
        self._save_keys.clear()
        self._drop_parked.extend(self.host.clear())
        for lane in self.queue:
            self._forget_parked(lane)
            lane.parked_tokens = 0

    def _engine_failed(self, exc: Exception) -> None:
        self._forget_engine_state()
        error = exc if isinstance(exc, SuperfluidError) else EngineFailure(f"engine error: {exc}")
        for lane in list(self.lanes):
            self._fail(lane, error)

    @staticmethod
    def _emit(lane: Lane, event: LaneEvent) -> None:
        try:
            lane.request.sink(event)
        except Exception:  # a broken sink must not stop the scheduler
            log.exception("sink of %s failed", lane.id)


@attrs.define(eq=False)
class _SaveOp:
    """A request to write cached KV to a park artifact, answered by the tick that does it."""

    tokens: list[int]
    path: str
    saved: list[int] | None = None
    done: threading.Event = attrs.field(factory=threading.Event)


def _kv_source(lane: Lane) -> int | None:
    """The slot whose KV holds ``lane.tokens[:lane.n_cached]`` when the next tick starts (copies
    are made then): its own slot, unless it is itself being copied in or restored this tick."""
    if not lane.needs_reset:
        return lane.slot
    if lane.restore is not None:
        return None
    return lane.copy_from if lane.copy_from is not None else lane.slot


def _count_by_class(lanes: list[Lane]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for lane in lanes:
        counts[lane.qos] = counts.get(lane.qos, 0) + 1
    return counts


def _timings(lane: Lane) -> dict:
    t = {"queued_at": lane.queued_at, "admitted_at": lane.admitted_at,
         "first_token_at": lane.first_token_at, "finished_at": lane.finished_at,
         "arrived": lane.request.arrived, "prefilled": lane.n_prefilled}
    return t


def _lane_view(slot: int, lane: Lane, now: float) -> dict:
    view = {"id": slot, "state": lane.state.value, "request_id": lane.id, "qos": lane.qos,
            "prompt_tokens": lane.n_prompt, "cached_tokens": lane.n_cached,
            "generated_tokens": lane.n_generated, "max_tokens": lane.request.max_tokens}
    if lane.admitted_at is not None and lane.n_prefilled:
        end = lane.first_token_at or now
        view["prefill_tokens_per_s"] = round(lane.n_prefilled / max(end - lane.admitted_at, 1e-6), 1)
    if lane.first_token_at is not None and lane.n_generated > 1:
        view["decode_tokens_per_s"] = round((lane.n_generated - 1) / max(now - lane.first_token_at, 1e-6), 1)
    return view
