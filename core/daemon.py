"""The daemon: builds each configured model (engine + scheduler), runs the front ends, and shuts
everything down in order."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from typing import Callable

import attrs

from .config import Config, ModelConfig
from .default_model import NAME as DEFAULT_MODEL_NAME, default_model_path
from .engine import Engine, EngineRegistry
from .errors import ModelNotFound
from .scheduler import Scheduler, SchedulerSettings

log = logging.getLogger("superfluid.daemon")


@attrs.define(eq=False)
class ModelRuntime:
    """One served model: its config, engine and scheduler."""

    config: ModelConfig
    engine: Engine
    scheduler: Scheduler

    @property
    def name(self) -> str:
        return self.config.name


class Daemon:
    def __init__(self, config: Config, pm):
        self.config = config
        self.pm = pm
        self.hook = pm.hook
        self.models: dict[str, ModelRuntime] = {}
        self.registry = EngineRegistry()
        self.hook.superfluid_add_engines(registry=self.registry)

    # ---- models ---------------------------------------------------------------------------

    def load_models(self, progress: Callable[[str], None] | None = None) -> None:
        for mc in self.config.models:
            if not mc.path:
                mc.path = default_model_path()
                mc.name = mc.name or DEFAULT_MODEL_NAME
            self.load_model(mc, progress)

    def load_model(self, mc: ModelConfig, progress: Callable[[str], None] | None = None) -> ModelRuntime:
        engine = self.registry.create(mc.engine, model=mc, config=self.config)
        engine.start(progress)
        caps = engine.capabilities
        settings = SchedulerSettings(
            max_batch=caps.max_lanes, context_length=caps.context_length,
            prefill_budget=mc["prefill-budget"], tick_decode_budget=mc["tick-decode-budget"],
            tick_target_ms=mc["tick-target-ms"], starvation_ticks=mc["starvation-ticks"],
            extra={**mc.values, "pinned-tokens": [engine.tokenize(text, add_special=True, parse_special=True)
                                                  for text in mc.values.get("pin-prompt") or []]})
        sources = [s for group in self.hook.superfluid_pressure_sources(config=self.config) for s in group or []]
        scheduler = Scheduler(mc.name, engine, self.hook, settings, pressure_sources=sources)
        scheduler.start()
        runtime = ModelRuntime(config=mc, engine=engine, scheduler=scheduler)
        self.models[mc.name] = runtime
        log.info("model %s ready: engine %s, %d lanes, context %d", mc.name, mc.engine,
                 caps.max_lanes, caps.context_length)
        return runtime

    def get(self, name: str | None) -> ModelRuntime:
        """The model a request names; with no name (or one model served), the first model."""
        if name in self.models:
            return self.models[name]
        if not name and self.models:
            return next(iter(self.models.values()))
        raise ModelNotFound(f"The model {name!r} does not exist; served models: "
                            f"{', '.join(self.models) or 'none'}", param="model")

    # ---- running --------------------------------------------------------------------------

    async def serve(self) -> None:
        """Start the front ends and wait for SIGINT/SIGTERM."""
        frontends = [fe for group in self.hook.superfluid_frontends(config=self.config, daemon=self)
                     for fe in (group or [])]
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        for fe in frontends:
            await fe.start()
        try:
            await stop.wait()
        finally:
            log.info("shutting down")
            for fe in reversed(frontends):
                await fe.stop()

    def close(self) -> None:
        for runtime in self.models.values():
            runtime.scheduler.close()
            runtime.engine.close()
        self.models.clear()


def print_progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
