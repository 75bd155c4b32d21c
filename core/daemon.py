"""The daemon: builds each configured model (engine + scheduler), runs the front ends, and shuts
everything down in order."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
import threading
from typing import Callable

import attrs

from .adapters import check_files, load_configured
from .config import CORE_OPTIONS, Config, ModelConfig
from .default_model import NAME as DEFAULT_MODEL_NAME, default_model_path
from .engine import Engine, EngineRegistry
from .errors import ModelNotFound, ServiceUnavailable
from .formats.registry import load as load_formats
from .formats.setup import ChatSetup, chat_setup
from .loop import ModelLoop
from .plugins import check_required_hooks
from .settings import SchedulerSettings
from .sessions import SessionStore

log = logging.getLogger("superfluid.daemon")


@attrs.define(eq=False)
class ModelRuntime:
    """One served model: its config, engine and loop (which holds its scheduler)."""

    config: ModelConfig
    engine: Engine
    loop: ModelLoop
    state: str = "ready"  # ready | unloading
    chat: ChatSetup | None = None  # its chat template and reply formats (None: a model built by hand)

    @property
    def name(self) -> str:
        return self.config.name


class ModelUnavailable(ServiceUnavailable):
    """The model is configured but not loaded right now (unloaded, loading or unloading)."""

    code = "model_unloaded"


RETRY_AFTER_S = "5"


class Daemon:
    def __init__(self, config: Config, pm):
        self.config = config
        self.pm = pm
        self.hook = pm.hook
        self.models: dict[str, ModelRuntime] = {}
        self.unloaded: dict[str, ModelConfig] = {}  # configured models unloaded at runtime
        self.loading: set[str] = set()
        self.draining = False  # shutting down: no new generations
        check_required_hooks(pm)
        self.registry = EngineRegistry()
        self.hook.superfluid_add_engines(register=self.registry.add)
        self.formats = load_formats(pm)
        self.sessions = SessionStore(CORE_OPTIONS.of(config).state_dir)
        self.sessions.recover()
        self._seal_locks: dict[str, threading.Lock] = {}  # one seal at a time per session

    # ---- models ---------------------------------------------------------------------------

    def load_models(self, progress: Callable[[str], None] | None = None) -> None:
        for mc in self.config.models:
            if not mc.path:
                mc.path = default_model_path()
                mc.name = mc.name or DEFAULT_MODEL_NAME
            self.load_model(mc, progress)

    def chat_setup(self, mc: ModelConfig, own_template: str | None) -> ChatSetup:
        """A model's chat template and reply formats, from its options (settled before it loads,
        so a bad template file is refused without loading the weights first, and after)."""
        core = CORE_OPTIONS.of(mc)
        return chat_setup(own_template, self.formats, template_file=core.chat_template_file,
                          template_name=core.chat_template, tool_parser=core.tool_call_parser,
                          reasoning_parser=core.reasoning_parser)

    def load_model(self, mc: ModelConfig, progress: Callable[[str], None] | None = None) -> ModelRuntime:
        self.chat_setup(mc, None)  # the options themselves are valid
        check_files(mc.name, CORE_OPTIONS.of(mc).lora)  # before the weights load
        engine = self.registry.create(mc.engine, model=mc, config=self.config)
        engine.start(progress)
        chat = self.chat_setup(mc, engine.info.chat_template)
        caps = engine.capabilities
        core = CORE_OPTIONS.of(mc)
        settings = SchedulerSettings(
            max_batch=caps.max_lanes, context_length=caps.context_length,
            prefill_budget=core.prefill_budget, tick_decode_budget=core.tick_decode_budget,
            tick_target_ms=core.tick_target_ms, starvation_ticks=core.starvation_ticks,
            park=core.park, pressure_high=core.pressure_high, pressure_low=core.pressure_low,
            max_queue=core.max_queue,
            host_cache_bytes=core.host_cache_mb << 20,
            pinned_tokens=[engine.tokenize(text, add_special=True, parse_special=True)
                           for text in core.pin_prompt or []],
            extra=dict(mc.values))
        sources: list = []
        self.hook.superfluid_add_pressure_sources(register=sources.append, config=self.config)
        loop = ModelLoop(mc.name, engine, self.hook, settings, pressure_sources=sources)
        loop.start()
        try:
            load_configured(loop, mc.engine, core.lora)  # --lora: through the loop's first ticks
        except Exception:
            loop.close(timeout=1)
            engine.close()
            raise
        runtime = ModelRuntime(config=mc, engine=engine, loop=loop, chat=chat)
        self.models[mc.name] = runtime
        log.info("model %s ready: engine %s, %d lanes, context %d", mc.name, mc.engine,
                 caps.max_lanes, caps.context_length)
        formats = chat.detected
        log.info("model %s chat template: %s; tool calls: %s (%s); reasoning: %s (%s)", mc.name, chat.source,
                 formats.tool_format.name if formats.tool_format else "none", formats.tool_source,
                 formats.reasoning.name if formats.reasoning else "none", formats.reasoning_source)
        return runtime

    def get(self, name: str | None) -> ModelRuntime:
        """The ready model a request names; with no name, the first model. A configured model
        that is not loaded right now (or a daemon shutting down) is a 503 with Retry-After."""
        if self.draining:
            raise ServiceUnavailable("the server is shutting down; retry on its successor",
                                     code="shutting_down", headers={"Retry-After": RETRY_AFTER_S})
        runtime = self.models.get(name) if name else next(iter(self.models.values()), None)
        if runtime is None and name:  # MODEL:ADAPTER, a LoRA adapter of a served model (vLLM's way)
            runtime = self._adapter_model(name)
        if runtime is not None and runtime.state == "ready":
            return runtime
        if runtime is not None or name in self.unloaded or name in self.loading or (not name and self.unloaded):
            raise ModelUnavailable(f"The model {name or next(iter(self.unloaded))!r} is not loaded right now; "
                                   "retry later", param="model", headers={"Retry-After": RETRY_AFTER_S})
        raise ModelNotFound(f"The model {name!r} does not exist; served models: "
                            f"{', '.join(self.models) or 'none'}", param="model")

    def _adapter_model(self, name: str) -> ModelRuntime | None:
        base, sep, adapter = name.rpartition(":")
        runtime = self.models.get(base) if sep else None
        return runtime if runtime is not None and runtime.loop.adapters.get(adapter) is not None else None

    def model_and_adapters(self, name: str) -> tuple[ModelRuntime | None, tuple]:
        """The served model a name means and the LoRA set it selects: a session opened on
        ``MODEL:ADAPTER`` keeps its KV (seal, park, restore) under that adapter's set only."""
        runtime = self.models.get(name)
        if runtime is not None:
            return runtime, ()
        runtime = self._adapter_model(name)
        adapter = runtime.loop.adapters.get(name.rpartition(":")[2]) if runtime is not None else None
        return (runtime, ((adapter.name, adapter.scale),)) if adapter is not None else (None, ())

    def model_states(self) -> dict[str, str]:
        states = {name: rt.state for name, rt in list(self.models.items())}
        states.update({name: "unloaded" for name in list(self.unloaded)})
        states.update({name: "loading" for name in list(self.loading)})
        return states

    def unload(self, name: str, drain_timeout: float) -> None:
        """Stop serving a model: new requests get 503 at once; running ones may finish within
        ``drain_timeout`` s, then fail with a clear error. Blocking (run it off the event loop)."""
        runtime = self.models.get(name)
        if runtime is None or runtime.state != "ready":
            if name in self.unloaded or (runtime is not None and runtime.state == "unloading"):
                return
            raise ModelNotFound(f"The model {name!r} does not exist", param="model")
        runtime.state = "unloading"
        log.info("model %s: unloading (draining up to %.1f s)", name, drain_timeout)
        runtime.loop.close(timeout=drain_timeout, reason=f"model {name!r} was unloaded; retry later",
                           code="model_unloaded")
        runtime.engine.close()
        self.unloaded[name] = runtime.config
        self.models.pop(name, None)
        log.info("model %s: unloaded", name)

    def reload(self, name: str, progress: Callable[[str], None] | None = None) -> ModelRuntime:
        """Load a model unloaded earlier. Blocking (run it off the event loop)."""
        if name in self.models and self.models[name].state == "ready":
            return self.models[name]
        if name not in self.unloaded:
            if name in self.loading:
                raise ServiceUnavailable(f"model {name!r} is already loading", code="model_loading",
                                         headers={"Retry-After": RETRY_AFTER_S})
            raise ModelNotFound(f"The model {name!r} is not configured (or not unloaded)", param="model")
        mc = self.unloaded.pop(name)
        self.loading.add(name)
        try:
            return self.load_model(mc, progress)
        except Exception:
            self.unloaded[name] = mc
            raise
        finally:
            self.loading.discard(name)

    # ---- running --------------------------------------------------------------------------

    async def serve(self) -> None:
        """Start the front ends, wait for SIGINT/SIGTERM, then shut down gracefully: stop
        admitting, let running requests finish, persist sessions, stop. A second signal skips
        the wait."""
        frontends: list = []
        self.hook.superfluid_add_frontends(register=frontends.append, config=self.config, daemon=self)
        stop, force = asyncio.Event(), asyncio.Event()
        loop = asyncio.get_running_loop()

        def on_signal() -> None:
            (force if stop.is_set() else stop).set()

        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, on_signal)
        for fe in frontends:
            await fe.start()
        try:
            await stop.wait()
            await self._drain(force)
            await loop.run_in_executor(None, self.persist_sessions)
            # What did not finish in time fails now with a clear error, so no handler is left
            # waiting when the front ends close.
            await loop.run_in_executor(None, self.stop_loops)
        finally:
            for fe in reversed(frontends):
                await fe.stop()

    async def _drain(self, force: asyncio.Event) -> None:
        timeout = CORE_OPTIONS.of(self.config).shutdown_timeout
        busy = [rt.name for rt in self.models.values() if rt.loop.busy()]
        log.info("shutting down: no new requests; waiting up to %.0f s for %s", timeout * 0.8,
                 ", ".join(busy) or "nothing")
        self.draining = True
        deadline = asyncio.get_running_loop().time() + timeout * 0.8
        while (any(rt.loop.busy() for rt in list(self.models.values())) and not force.is_set()
               and asyncio.get_running_loop().time() < deadline):
            await asyncio.sleep(0.05)

    def persist_sessions(self) -> None:
        """Write every open session's KV to its park artifact (with --state-dir and --park), so a
        restarted daemon serves the next turn without prefilling the conversation again."""
        if self.sessions.dir is None:
            return
        saved = 0
        for session in list(self.sessions.sessions.values()):
            if session.state != "open" or not session.prompt_tokens:
                continue
            runtime, adapters = self.model_and_adapters(session.model)
            if runtime is None or not CORE_OPTIONS.of(runtime.config).park:
                continue
            lock = self._seal_lock(session)
            if not lock.acquire(timeout=10):  # a seal still writing it: that artifact stands
                continue
            try:
                tokens = runtime.loop.save_prefix(session.prompt_tokens,
                                                  self.sessions.artifact_path(session.id), timeout=10, **_lora(adapters))
                if tokens:
                    self.sessions.parked(session, tokens)
                    saved += 1
            finally:
                lock.release()
        log.info("persisted %d sessions' KV to %s", saved, self.sessions.dir)

    def seal_session(self, session) -> int:
        """With --park and --state-dir, write a session's KV (its turn just finished, its lane's
        KV cached) to its park artifact, the path an explicit park and the shutdown take, so a
        daemon killed afterwards restores the session warm. The session stays open. Blocks until
        the tick that writes it; tokens sealed (0: nothing, e.g. no --park or no state dir)."""
        runtime, adapters = self.model_and_adapters(session.model)
        path = self.sessions.artifact_path(session.id)
        if (runtime is None or path is None or not CORE_OPTIONS.of(runtime.config).park
                or not session.prompt_tokens or session.state == "closed"):
            return 0
        with self._seal_lock(session):
            if session.state == "closed":  # closed while this seal waited for the lock
                return 0
            tokens = runtime.loop.save_prefix(session.prompt_tokens, path, **_lora(adapters))
            if tokens and session.state == "closed":  # closed while it was written: not kept
                self.sessions._drop_artifact(session)
                return 0
            if tokens:
                self.sessions.sealed(session, tokens, runtime.loop)
        return len(session.artifact_tokens or []) if tokens else 0

    def settle_closed_session(self, session, wait_s: float = 10.0) -> None:
        """After a session is closed: wait for a seal still writing its park artifact (the last
        turn's, in the background), then delete what it wrote, so no artifact of the closed
        session is left when this returns. Seals that start later see the session closed and
        write nothing. Past ``wait_s`` it returns; that seal then removes its own artifact."""
        lock = self._seal_lock(session)
        if lock.acquire(timeout=wait_s):
            try:
                self.sessions.close_artifact(session)
            finally:
                lock.release()
        self._seal_locks.pop(session.id, None)

    def _seal_lock(self, session) -> threading.Lock:
        """One KV write per session at a time (a seal, a park, the shutdown's), so two never
        write the same artifact in one tick nor its metadata at once."""
        return self._seal_locks.setdefault(session.id, threading.Lock())

    def park_session(self, session) -> int:
        """Park a session: its KV goes to its park artifact when it can. Tokens saved."""
        runtime, adapters = self.model_and_adapters(session.model)
        tokens = None
        path = self.sessions.artifact_path(session.id)
        with self._seal_lock(session):
            if (runtime is not None and path is not None and CORE_OPTIONS.of(runtime.config).park
                    and session.prompt_tokens):
                tokens = runtime.loop.save_prefix(session.prompt_tokens, path, **_lora(adapters))
            self.sessions.parked(session, tokens)
        return len(session.artifact_tokens or []) if tokens else 0

    def stop_loops(self) -> None:
        for runtime in list(self.models.values()):
            runtime.loop.close(timeout=0.5)

    def close(self) -> None:
        for runtime in self.models.values():
            runtime.loop.close()
            runtime.engine.close()
        self.models.clear()


def _lora(adapters: tuple) -> dict:
    """``save_prefix``'s adapters argument, given only for a session on an adapter."""
    return {"adapters": adapters} if adapters else {}


def print_progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
