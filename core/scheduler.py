"""The scheduler: decides which lanes run, which are preempted, what a tick does and what its
result means. No thread and no lock: ``core/loop.py`` calls it with the model's lock held, and
tests call it directly.

    plan = scheduler.schedule(now)          # expire, admit (bind or preempt), plan the tick
    result = engine.run_tick(plan)
    stats = scheduler.postprocess(plan, result)   # commit tokens, finish, relieve pressure

Policies (admission order, victims, the tick's split, pressure victims) are hooks; the KV
manager (``core/kv.py``) answers which slot and seed, and what to free. The scheduler applies
those answers, and what each tick did, through the lanes' methods (``core/lane.py``)."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from . import qos
from .adapter_cache import AdapterKV
from .adapter_groups import GroupClock
from .costs import CostModel
from .errors import DeadlineExceeded, EngineFailure
from .lane import Lane, LaneEvent, LaneState
from .pressure import PressureGauge
from .prompt_work import annotate, collect, embedding, newly_scored, prompt_scores
from .settings import SchedulerSettings
from .stats import TickStats, count_by_class, timings
from .tick import TickPlan, TickResult

if TYPE_CHECKING:
    from .engine import EngineCapabilities
    from .pressure import PressureSource

log = logging.getLogger("superfluid.scheduler")


class Scheduler:
    def __init__(self, name: str, capabilities: EngineCapabilities, hook, settings: SchedulerSettings,
                 pressure_sources: list[PressureSource] | None = None):
        self.name = name
        self.hook = hook
        self.settings = settings
        self.costs = CostModel()
        self.queue: list[Lane] = []
        self.lanes: list[Lane] = []
        self.kv = AdapterKV(name, capabilities, settings)  # a KVManager that drops an unloaded adapter's prefixes
        self.gauge = PressureGauge(name, pressure_sources or [])
        self.groups = GroupClock()  # adapter sets' waits, on engines that run one set per tick
        self.ticks = 0
        self._preempted = self._promoted = 0

    @property
    def pressure(self) -> str:
        return self.gauge.level

    # ---- requests --------------------------------------------------------------------------

    def add(self, lane: Lane) -> None:
        self.queue.append(lane)

    def cancel(self, request_id: str) -> bool:
        """Cancel a queued lane now, or mark a running one; True if a tick must stop for it."""
        for lane in self.queue:
            if lane.id == request_id:
                self.queue.remove(lane)
                self.finish(lane, "cancelled", LaneState.CANCELLED)
                return False
        for lane in self.lanes:
            if lane.id == request_id and not lane.cancel_requested:
                lane.request_cancel()
                return True
        return False

    def busy(self) -> bool:
        return bool(self.queue or self.lanes)

    # ---- schedule --------------------------------------------------------------------------

    def schedule(self, now: float, admit: bool = True) -> TickPlan:
        """The next tick's plan; ``admit`` False (closing) runs what is running and admits none."""
        self._finish_cancelled()
        self.kv.artifacts.stage_loads(self.kv.host)
        if admit:
            self._admit(now)
        for lane in self.queue:
            lane.tick_passed(served=False)
        plan = TickPlan()
        if self.lanes:
            self.groups.stamp(self.lanes)
            plan = self.hook.superfluid_plan_tick(
                lanes=list(self.lanes), queue=list(self.queue), costs=self.costs,
                capabilities=self.kv.caps, settings=self.settings, now=now)
            self.groups.count(self.lanes, plan, per_tick=getattr(self.kv.caps, "adapters", "none") == "per_tick")
        self._age_prefilling({lp.slot for lp in plan.lanes})
        self.kv.fill_plan(plan)
        annotate(plan, self.lanes)
        return plan

    def _age_prefilling(self, planned: set[int]) -> None:
        """Admitted lanes left without prefill age toward starvation too, but only when a lane
        admitted after them, or one of a higher class, was fed instead. Behind a lane of its own
        class admitted no later, a lane is waiting its turn (shortest remaining prompt first),
        which ends when that lane's prompt does: lanes admitted in one pass are a fixed set, and
        were the one fed first (the shortest, a requeued lane or one a cached prefix seeded) to
        age the others, they would all starve together and take a chunk each in turn, and every
        first token among them would come late."""
        prefilling = [l for l in self.lanes if l.is_prefilling]
        served = [l for l in prefilling if l.slot in planned]
        for lane in prefilling:
            if lane.slot in planned:
                lane.tick_passed(served=True)
                continue
            passed = any((s.admitted_at or 0.0) > (lane.admitted_at or 0.0)
                         or qos.priority(s.qos) < qos.priority(lane.qos) for s in served)
            lane.tick_passed(served=False, passed_over=passed)

    def _admit(self, now: float) -> None:
        """Fill free lanes in policy order; with none free, let the policy preempt for a lane."""
        self.kv.begin_admission()
        self._expire(now)
        waiting = self.kv.waiting_for_shared_prefix(self.queue, self.lanes) if self.kv.free_lanes else set()
        while self.queue:
            slots = self.kv.slot_state()
            if slots == "later":  # every free slot is a cache lanes copy from this tick
                return
            candidates = [l for l in self.queue if l not in waiting]
            lane = self.hook.superfluid_pick_next(
                queue=candidates, lanes=list(self.lanes), now=now, settings=self.settings,
                free_lanes=self.kv.free_lanes, pressure=self.pressure) if candidates else None
            if lane is None:
                return
            if self.kv.parks_full() and lane.qos not in qos.URGENT:
                return  # this tick already copies enough evicted KV: the streams would stall on more
            if slots == "full" or not self.kv.room_for(lane, self.lanes):
                victim = self.hook.superfluid_choose_victim(lane=lane, lanes=list(self.lanes),
                                                            settings=self.settings)
                if victim is None or victim not in self.lanes or victim.pinned:
                    return
                self.preempt(victim)
            self._bind(lane, now)
            waiting |= self.kv.waiting_for_shared_prefix(self.queue, [lane])

    def _bind(self, lane: Lane, now: float) -> None:
        self.queue.remove(lane)
        if lane.waited_ticks >= self.settings.starvation_ticks:
            self._promoted += 1
        first = lane.bind(self.kv.bind(lane, self.lanes), now)
        self.lanes.append(lane)
        if first:
            self._emit(lane, LaneEvent("admitted", lane.id, timings={"queued_s": now - lane.queued_at}))
        else:
            self._emit(lane, LaneEvent("resumed", lane.id))

    def preempt(self, lane: Lane) -> None:
        """Stop a running lane and requeue it at the head of its class; park its KV if allowed."""
        release = self.kv.unbind(lane, self.lanes)
        for other, not_reused in release.unseeded:  # their seed was to be copied from its slot
            other.lose_kv(not_reused)
        lane.preempt(release)
        self.lanes.remove(lane)
        self.queue.insert(0, lane)
        self._preempted += 1
        log.info("model %s: preempted %s (%s)%s", self.name, lane.id, lane.qos,
                 " parking its KV" if lane.parked else "")
        self._emit(lane, LaneEvent("paused", lane.id))

    def _expire(self, now: float) -> None:
        for lane in [l for l in self.queue if l.request.start_deadline is not None
                     and l.admitted_at is None and now > l.request.start_deadline]:
            self.queue.remove(lane)
            self.fail(lane, DeadlineExceeded(
                "the request could not start before its deadline (--completion-deadline-ms); retry later",
                headers={"Retry-After": "1"}))

    # ---- postprocess -----------------------------------------------------------------------

    def postprocess(self, plan: TickPlan, result: TickResult) -> TickStats:
        """Commit a tick: seeds that failed, tokens (streamed, finishing lanes), cancellations,
        then the pool: OS pressure, a refused plan, the watermarks."""
        self.ticks += 1
        self.costs.observe(result.steps)
        for lane in self.kv.tick_done(result):  # its KV could not be parked
            lane.unpark()
        by_slot = {lane.slot: lane for lane in self.lanes}
        now = time.monotonic()
        first_tokens: list[tuple[str, float]] = []
        finished: list[Lane] = []
        decode_tokens = prefilled = 0
        for lp in plan.lanes:
            lane = by_slot.get(lp.slot)
            res = result.lanes.get(lp.slot)
            if lane is None:
                continue
            lane.reset_done()
            if res is None:
                continue
            if res.restore_failed:
                lane.lose_kv(self.kv.seed_failed(lane, lp.seed, lp.pos))
                continue
            if res.error is not None:  # this request alone failed in the engine; its slot is cleared
                self.fail(lane, EngineFailure(f"model {self.name!r}: {res.error}", code="image_encoding_failed"))
                continue
            lane.note_fed(res.n_fed, res.n_prefill)
            prefilled += res.n_prefill
            if res.n_prefill:
                self.kv.prefilled(lane)
            decode_tokens += len(res.tokens)
            collect(lane, lp, res)
            if newly_scored(lane):
                self._emit(lane, LaneEvent("scored", lane.id, prompt_logprobs=prompt_scores(lane)))
            if lane.embedded:  # an embedding samples nothing: its prompt computed, it is done
                self.finish(lane, "stop", LaneState.FINISHED)
                finished.append(lane)
                continue
            if res.tokens and lane.first_token_at is None:
                lane.note_first_token(now)
                first_tokens.append((lane.qos, now - lane.admitted_at))
            if self._commit_tokens(lane, res.tokens, res.eog, res.logprobs):
                finished.append(lane)
            elif lane.active:
                lane.refresh_state()
        finished += self._finish_cancelled()
        self._relieve(now, result, progressed=bool(prefilled or decode_tokens))
        evictions, hits, hit_tokens, rejections, host_hits = self.kv.take_counters()
        preempted, promoted, self._preempted, self._promoted = self._preempted, self._promoted, 0, 0
        kv = self.kv
        return TickStats(
            model=self.name, seconds=result.seconds, prefill_tokens=prefilled,
            decode_tokens=decode_tokens, prefill_budget=plan.prefill_budget,
            decode_grant=plan.decode_grant, lanes_busy=len(self.lanes),
            max_lanes=self.settings.max_batch, queue_depth=len(self.queue),
            stopped_early=result.stopped_early, quiet=plan.quiet, target_s=plan.target_s, kv_used=kv.used,
            kv_capacity=kv.capacity, first_tokens=first_tokens, finished=finished,
            queue_by_class=count_by_class(self.queue), lanes_by_class=count_by_class(self.lanes),
            preempted=preempted, promoted=promoted, parked_bytes=kv.parked_bytes,
            cache_hits=hits, cache_hit_tokens=hit_tokens, cache_host_hits=host_hits,
            cached_tokens=kv.cache.cached_tokens(),
            evictions=evictions, host_entries=len(kv.host), host_bytes=kv.host.bytes,
            pressure=self.pressure, pool_rejections=rejections,
            drafted_tokens=sum(s.drafted for s in result.steps), accepted_tokens=sum(s.accepted for s in result.steps),
            verify_steps=sum(1 for s in result.steps if s.drafted), images_encoded=result.encoded,
            cache_events=kv.take_cache_events())

    def _commit_tokens(self, lane: Lane, tokens: list[int], eog: bool, logprobs=()) -> bool:
        """Stream a lane's sampled tokens (with their logprobs, if asked for); True if they
        finished it."""
        if not tokens:
            return False
        text, used, reason = lane.take(tokens, eog, self.settings.context_length)
        if text or used:
            self._emit(lane, LaneEvent("delta", lane.id, text=text, token_ids=used,
                                       logprobs=tuple(logprobs[:len(used)])))
        if reason is not None:
            self.finish(lane, reason, LaneState.FINISHED)
            return True
        return False

    def _relieve(self, now: float, result: TickResult, progressed: bool) -> None:
        """OS pressure first (under it nothing may move to host memory), then a plan the pool
        refused, then the watermarks."""
        if self.gauge.poll(now) and self.pressure != "ok":
            log.warning("model %s: OS memory pressure %s: evicting cached prefixes", self.name, self.pressure)
            self.kv.os_pressure(self.pressure, now)
            victims = self.hook.superfluid_pressure_victims(
                level=self.pressure, lanes=list(self.lanes), settings=self.settings) or []
            for lane in victims:
                if lane in self.lanes and not lane.pinned:
                    self.preempt(lane)
        if result.rejected_tokens:
            verdict = self.kv.pool_refused(result.rejected_tokens, self.lanes, progressed)
            for lane in verdict.requeue:
                self.preempt(lane)
            if verdict.fail is not None:
                self.fail(verdict.fail, EngineFailure(f"model {self.name!r}: the KV pool cannot hold this request"))
        else:
            self.kv.pool_progressed()
        self.kv.relieve()

    # ---- ending lanes ------------------------------------------------------------------------

    def _finish_cancelled(self) -> list[Lane]:
        cancelled = [l for l in self.lanes if l.cancel_requested]
        for lane in cancelled:
            self.finish(lane, "cancelled", LaneState.CANCELLED)
        return cancelled

    def finish(self, lane: Lane, reason: str, state: LaneState) -> None:
        tail = lane.text.flush() if reason != "cancelled" else ""
        if tail:
            self._emit(lane, LaneEvent("delta", lane.id, text=tail))
        self._end(lane, state, reason, keep_kv=True)
        self._emit(lane, LaneEvent("finished", lane.id, finish_reason=reason, stop_string=lane.text.stop_string,
                                   prompt_tokens=lane.n_prompt, completion_tokens=lane.n_output,
                                   cached_tokens=min(lane.n_reused, lane.n_prompt),
                                   prompt_logprobs=prompt_scores(lane), embedding=embedding(lane),
                                   timings=timings(lane)))
        self.hook.superfluid_lane_finished(model=self.name, lane=lane)

    def fail(self, lane: Lane, exc: BaseException) -> None:
        self._end(lane, LaneState.FINISHED, "error")
        self._emit(lane, LaneEvent("error", lane.id, error=exc, timings=timings(lane)))
        self.hook.superfluid_lane_finished(model=self.name, lane=lane)

    def fail_running(self, exc: BaseException) -> None:
        for lane in list(self.lanes):
            self.fail(lane, exc)

    def fail_queued(self, exc: BaseException) -> None:
        queued, self.queue = self.queue, []
        for lane in queued:
            self.fail(lane, exc)

    def engine_failed(self, exc: BaseException) -> None:
        """The engine failed a tick: its KV may be gone; running lanes fail, queued ones wait."""
        self._forget_engine_state()
        self.fail_running(exc)

    def engine_lost(self) -> None:
        """The engine crashed and restarts empty: every lane resumes from its tokens."""
        self._forget_engine_state()
        self.kv.engine_restarted()
        for lane in self.lanes:
            lane.lose_kv()

    def _forget_engine_state(self) -> None:
        self.kv.forget_engine_state(self.queue)
        for lane in self.queue:  # a parked KV is gone with the engine's state
            lane.unpark()

    def _end(self, lane: Lane, state: LaneState, reason: str, keep_kv: bool = False) -> None:
        """The lane is done: free its slot and its parked KV. With ``keep_kv`` its KV stays as a
        cached prefix for later lanes."""
        now = time.monotonic()
        if lane in self.lanes:
            self.lanes.remove(lane)
        self.kv.release(lane, keep_kv)
        lane.end(state, reason, now)

    @staticmethod
    def _emit(lane: Lane, event: LaneEvent) -> None:
        try:
            lane.request.sink(event)
        except Exception:  # a broken sink must not stop the scheduler
            log.exception("sink of %s failed", lane.id)
