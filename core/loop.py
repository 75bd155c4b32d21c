"""A model's loop: its thread and lock, the API front ends call from any thread, and ``step()``.

One thread per model runs ``step()`` (schedule → ``engine.run_tick`` → postprocess →
``superfluid_tick_done``) while there is work. Front ends call :meth:`ModelLoop.submit`,
:meth:`cancel` and the prefix calls from their own threads and hear back through each request's
sink. The loop also owns what happens when the engine fails a tick or its worker dies."""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

from .constrain import UnsupportedConstraint
from .constrain import check as check_constraint
from .errors import (ContextLengthExceeded, EngineCrashed, EngineFailure, InvalidRequest, QueueFull,
                     ServiceUnavailable, SuperfluidError)
from .adapters import Adapter, AdapterTable, adapters_in_use
from .arrivals import ArrivalWindow
from .artifacts import SaveOp
from .lane import Lane
from .scheduler import Scheduler
from .settings import SchedulerSettings
from .stats import snapshot
from .textstream import TextStream

if TYPE_CHECKING:
    from .engine import Engine
    from .pressure import PressureSource
    from .request import Request
    from .stats import TickStats

log = logging.getLogger("superfluid.loop")

MAX_CRASHES = 5            # engine crashes within CRASH_WINDOW_S before a model is given up
CRASH_WINDOW_S = 60.0
QUEUE_RETRY_AFTER_S = 1    # Retry-After of a 429 queue_full


class ModelLoop:
    def __init__(self, name: str, engine: Engine, hook, settings: SchedulerSettings,
                 pressure_sources: list[PressureSource] | None = None):
        self.name = name
        self.engine = engine
        self.hook = hook
        self.settings = settings
        self.scheduler = Scheduler(name, engine.capabilities, hook, settings, pressure_sources)
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = self._aborted = False
        self._close_reason, self._close_code = f"model {name!r} is shutting down", "shutting_down"
        self.arrivals = ArrivalWindow()
        self._crashes: list[float] = []
        self._quiet_tick = False  # the tick in flight is a quiet one (TickPlan.quiet)
        self.adapters = AdapterTable(name)  # its LoRA adapters (core/adapters.py)

    @property
    def lanes(self) -> list[Lane]:
        return self.scheduler.lanes

    @property
    def queue(self) -> list[Lane]:
        return self.scheduler.queue

    # ---- front-end side (any thread) ---------------------------------------------------------

    def submit(self, request: Request) -> Lane:
        """Queue a request. Raises if it can never run (empty, longer than the context, or of a
        kind this model cannot serve): the one place, for every front end, where these are checked."""
        n, ctx = len(request.prompt_tokens), self.settings.context_length
        if n == 0:
            raise SuperfluidError("the prompt is empty", status=400, code="invalid_prompt")
        if n >= ctx:
            raise ContextLengthExceeded(
                f"This model's maximum context length is {ctx} tokens, but the prompt has {n} tokens.",
                param="messages" if request.meta.get("chat") else "prompt")
        self._check_kind(request)
        lane = Lane(request=request, text=TextStream(self.engine.token_bytes, request.stop))
        with self._cv:
            if self._closed:
                raise self._closed_error()
            self._check_queue(request)
            self.adapters.check(request.adapters)  # an adapter unloaded since the front end looked
            self.scheduler.add(lane)
            self.arrivals.arrived(time.monotonic())
            self._cv.notify()
            running = self.scheduler.lanes
            if running and self.hook.superfluid_should_stop_tick(lane=lane, lanes=list(running),
                                                                 settings=self.settings):
                self.engine.request_stop()
            elif self._quiet_tick:  # it promised to yield to a newcomer
                self.engine.request_yield()
        return lane

    def check_serves(self, embed: bool) -> None:
        """An embedding where this model's engine computes none, or a generation from an
        embedding-only model, as a 400. Submit checks it for every request; a front end may ask
        first, before it tokenizes a batch of inputs for nothing."""
        caps = self.engine.capabilities
        if embed and not getattr(caps, "embeddings", False):
            raise InvalidRequest(f"model {self.name!r} does not serve embeddings (its engine cannot "
                                 "compute them)", code="embeddings_not_supported", param="model")
        if not embed and not getattr(caps, "generates", True):
            raise InvalidRequest(f"model {self.name!r} is embedding-only (embedding-only = true): use "
                                 "/v1/embeddings", code="model_not_generative", param="model")

    def check_takes_images(self, param: str = "messages") -> None:
        """Images sent to a model whose engine takes none (a text-only model, or a vision model
        loaded without its vision half), as a 400 that says so: where the engine serves only a
        vision-language model's language half, in its own words (who serves the images)."""
        caps = self.engine.capabilities
        if not getattr(caps, "vision", False) or self.engine.info.vision is None:
            reason = getattr(caps, "images_not_served", None)
            if reason:
                raise InvalidRequest(f"model {self.name!r} takes no images here: {reason}",
                                     code="images_not_served", param=param)
            raise InvalidRequest(f"model {self.name!r} is text-only: it takes no images (serve a vision model with "
                                 "its mmproj to send images)", code="model_not_multimodal", param=param)

    def _check_kind(self, request: Request) -> None:
        """What this model cannot serve, whatever front end sent it, as a 400: an embedding where
        its engine computes none, a generation from an embedding-only model, a constraint that
        cannot be enforced (refused, never sampled freely). Front ends leave these to this one
        check; ``request.meta["constraint_param"]`` names the field a constraint came from."""
        self.check_serves(embed=request.embed)
        if request.media:
            self.check_takes_images(param=request.meta.get("media_param", "messages"))
            if request.embed or request.prompt_logprobs is not None:
                raise InvalidRequest("images may not be scored or embedded, only generated from",
                                     code="unsupported_value", param=request.meta.get("media_param", "messages"))
        if request.sampling.constrained:
            try:
                check_constraint(request.sampling)
            except UnsupportedConstraint as exc:
                param = request.meta.get("constraint_param")
                where = f"{param}: " if param else ""
                reason = str(exc).strip().splitlines()[0] if str(exc).strip() else "rejected by llguidance"
                raise InvalidRequest(f"{where}this schema cannot be enforced: {reason}", code="unsupported_schema",
                                     param=param) from None

    def _check_queue(self, request: Request) -> None:
        """A class whose queue already holds --max-queue requests refuses one more: a 429 the
        client can retry, never an unbounded queue. (Under the lock.)"""
        most = self.settings.max_queue
        if most and sum(1 for lane in self.scheduler.queue if lane.request.qos == request.qos) >= most:
            raise QueueFull(f"model {self.name!r}: {most} {request.qos} requests are already queued "
                            "(--max-queue); retry later", headers={"Retry-After": str(QUEUE_RETRY_AFTER_S)})

    def cancel(self, request_id: str) -> None:
        """Cancel a request wherever it is; a running tick ends at the engine's next step."""
        with self._cv:
            if self.scheduler.cancel(request_id):
                self.engine.request_stop()
                self._cv.notify()

    def save_prefix(self, tokens: list[int], path: str, timeout: float = 60.0,
                    adapters: tuple = ()) -> list[int] | None:
        """Write the cached KV that best covers ``tokens`` to a park artifact at ``path`` (a
        session's KV, outliving this process). Returns the tokens the artifact holds, or None when
        nothing of them is cached or the engine cannot persist KV. Blocks until the next tick.
        Only KV computed under ``adapters`` (a LoRA set: the session's) is saved."""
        if not self.engine.capabilities.persists_kv:
            return None
        op = SaveOp(tokens=list(tokens), path=path, adapters=tuple(adapters))
        with self._cv:
            if self._closed and self._thread is not None and not self._thread.is_alive():
                return None
            self.scheduler.kv.artifacts.save(op)
            self._cv.notify()
        if not op.done.wait(timeout):
            return None
        return op.saved

    def pin_prefix(self, tokens: list[int], pin: bool = True) -> None:
        """Pin (or, with ``pin`` false, unpin) a prompt prefix at runtime: cached KV starting
        with it is evicted last, like --pin-prompt's."""
        with self._cv:
            self.scheduler.kv.pin(list(tokens), pin)

    def adopt_prefix(self, tokens: list[int], path: str, adapters: tuple = ()) -> bool:
        """Load a park artifact holding ``tokens`` into the host tier at the next tick, so the next
        request that starts with them (under the LoRA set ``adapters``, the artifact's) restores
        instead of prefilling. False if unsupported."""
        caps = self.engine.capabilities
        if not (caps.persists_kv and caps.prefix_cache):
            return False
        with self._cv:
            self.scheduler.kv.artifacts.load(path, tokens, tuple(adapters))
            self._cv.notify()
        return True

    def load_adapter(self, name: str, path: str, scale: float = 1.0, timeout: float = 120.0) -> Adapter:
        """Load a LoRA adapter at the next tick (under traffic: before that tick's lanes) and wait
        for the engine's answer. Raises :class:`EngineFailure` (with its reason) if the engine
        could not load it; the adapter is then unknown, as before."""
        caps = self.engine.capabilities
        if getattr(caps, "adapters", "none") == "none":
            raise InvalidRequest(f"model {self.name!r}: its engine serves no LoRA adapters", code="adapters_not_supported")
        with self._cv:
            adapter = self.adapters.add(name, path, scale)
            self._cv.notify()
        if not adapter.done.wait(timeout):
            raise EngineFailure(f"model {self.name!r}: LoRA adapter {name!r} is still loading after {timeout:.0f} s")
        if adapter.error is not None:
            raise EngineFailure(f"model {self.name!r}: LoRA adapter {name!r} could not be loaded: {adapter.error}",
                                code="adapter_load_failed")
        return adapter

    def unload_adapter(self, name: str, timeout: float = 30.0) -> bool:
        """Stop serving a LoRA adapter now (new requests naming it get 404); lanes running or
        queued under it finish, then the engine unloads it. True once unloaded within
        ``timeout``, False while its lanes still run (it is unloaded when they end)."""
        with self._cv:
            adapter = self.adapters.remove(name)
            self._cv.notify()
        return adapter.done.wait(timeout)

    def snapshot(self) -> dict:
        """Per-slot state for /slots."""
        with self._cv:
            return snapshot(self.scheduler, time.monotonic())

    def busy(self) -> bool:
        with self._cv:
            return self.scheduler.busy()

    # ---- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=f"loop-{self.name}", daemon=True)
        self._thread.start()

    def close(self, timeout: float = 10.0, reason: str | None = None, code: str = "shutting_down") -> None:
        """Stop admitting; let running lanes finish for up to ``timeout`` s, then fail them
        (503 with ``reason`` and ``code``)."""
        self._close_reason = reason or f"model {self.name!r} is shutting down"
        self._close_code = code
        with self._cv:
            self._closed = True
            self.scheduler.fail_queued(self._closed_error())
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

    @property
    def running(self) -> bool:
        """The loop's thread is alive."""
        return self._thread is not None and self._thread.is_alive()

    def _closed_error(self) -> ServiceUnavailable:
        return ServiceUnavailable(self._close_reason, code=self._close_code, headers={"Retry-After": "5"})

    # ---- the loop (the model's thread) ----------------------------------------------------------

    def _run(self) -> None:
        while self._wait_for_work():
            self.step()
        log.info("model %s: loop stopped", self.name)

    def _wait_for_work(self) -> bool:
        """Block until there is something to do; False once closed and drained."""
        sched = self.scheduler
        with self._cv:
            while not (self._closed or sched.busy() or sched.kv.has_work()
                       or self.adapters.has_work(adapters_in_use(sched.lanes, sched.queue))):
                self._cv.wait()
            if self._closed and not (sched.lanes or sched.kv.artifacts.has_saves()):
                return False
            if not sched.lanes:
                self.arrivals.gather(self._cv, lambda: self._closed or any(
                    l.request.start_deadline for l in sched.queue))
        return True

    def step(self) -> TickStats | None:
        """One tick: schedule, run it on the engine, postprocess, tell the observers. Returns its
        stats, or None when nothing ran (nothing runnable, or the engine failed)."""
        sched = self.scheduler
        with self._cv:
            self.engine.clear_stop()
            self._quiet_tick = False
            if self._aborted:
                sched.fail_running(self._closed_error())
            try:
                plan = sched.schedule(time.monotonic(), admit=not self._closed)
            except Exception as exc:  # a policy hook failed: fail what it touched, keep the thread
                log.exception("model %s: planning failed", self.name)
                error = EngineFailure(f"scheduling policy failed: {exc}")
                sched.fail_running(error)
                sched.fail_queued(error)
                return None
            self.adapters.fill_plan(plan, adapters_in_use(sched.lanes, sched.queue))
            if plan.empty():  # nothing runnable now (e.g. every queued class at its cap)
                self._cv.wait(0.05)
                return None
            self._quiet_tick = plan.quiet
        try:
            result = self.engine.run_tick(plan)
        except EngineCrashed as exc:  # the worker died: restart it, lanes resume from their tokens
            log.error("model %s: %s", self.name, exc)
            with self._cv:
                self.adapters.tick_failed(str(exc))
            self._recover(exc)
            return None
        except Exception as exc:  # the engine failed: fail its lanes, keep serving others
            log.exception("model %s: tick failed", self.name)
            with self._cv:
                self.adapters.tick_failed(str(exc))
                sched.engine_failed(exc if isinstance(exc, SuperfluidError) else EngineFailure(f"engine error: {exc}"))
            return None
        with self._cv:
            self._quiet_tick = False
            for name in self.adapters.tick_done(result.adapter_errors):
                sched.kv.drop_adapter(name)  # a later adapter of that name is another
            stats = sched.postprocess(plan, result)
        self.hook.superfluid_tick_done(model=self.name, stats=stats)
        return stats

    def _recover(self, exc: Exception) -> None:
        """Restart a crashed engine and resume every lane from its prompt + generated tokens, so
        clients see a pause, not repeated or lost text. Repeated crashes back off, then fail."""
        now = time.monotonic()
        self._crashes = [t for t in self._crashes if now - t < CRASH_WINDOW_S] + [now]
        sched = self.scheduler
        with self._cv:
            sched.engine_lost()
        if len(self._crashes) > MAX_CRASHES:
            with self._cv:
                sched.engine_failed(EngineFailure(
                    f"model {self.name!r}: engine crashed {len(self._crashes)} times in "
                    f"{CRASH_WINDOW_S:.0f} s; not restarting ({exc})"))
                sched.fail_queued(EngineFailure(f"model {self.name!r} is down: its engine keeps crashing"))
                self._closed = True
            return
        time.sleep(min(2 ** (len(self._crashes) - 1) * 0.5, 8.0))  # back off before restarting
        try:
            self.engine.restart()
            with self._cv:
                self.adapters.engine_restarted()
            log.warning("model %s: engine restarted; %d lanes resume", self.name, len(sched.lanes))
        except Exception as restart_exc:  # noqa: BLE001 - reported to the lanes
            log.exception("model %s: restart failed", self.name)
            with self._cv:
                sched.engine_failed(EngineFailure(f"model {self.name!r}: restart failed: {restart_exc}"))
