"""The hook specifications: Superfluid's public plugin API.

Grouped by phase. Decision hooks are ``firstresult``: the first plugin that answers (not None)
wins, so a plugin listed in the TOML ``plugins`` key, registered after the built-ins, overrides
them (pluggy calls later-registered plugins first). Observer hooks call every plugin.
Registrar hooks receive a ``register`` callable and call it once per thing they add.

Each hook says which thread calls it. "The model's thread" is the one running that model's
:class:`~superfluid.core.loop.ModelLoop`; a hook called there holds the model's lock, so it
must be quick and must not call back into the loop.

Set ``SUPERFLUID_TRACE_HOOKS=1`` to log every hook call and its result.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import pluggy

if TYPE_CHECKING:
    from .config import Config, ModelRegistrar, Schema
    from .costs import CostModel
    from .daemon import Daemon
    from .engine import EngineCapabilities, EngineFactory
    from .formats.family import ReasoningFormat, ToolFormat
    from .formats.setup import NamedTemplate
    from .lane import Lane
    from .pressure import PressureSource
    from .settings import SchedulerSettings
    from .stats import TickStats
    from .tick import TickPlan

hookspec = pluggy.HookspecMarker("superfluid")
hookimpl = pluggy.HookimplMarker("superfluid")


# ---- startup: configuration and registrars ---------------------------------------------------
# add_config, add_models, configure and add_engines run once on the main thread before any model
# loads; add_pressure_sources once per model load (an executor thread for a load through /admin);
# add_frontends once the models are loaded.

@hookspec
def superfluid_add_config(schema: Schema) -> None:
    """Declare configuration options.

    :param schema: ``OPTIONS.declare(schema)`` for a
        :class:`~superfluid.core.options.PluginOptions` holding the plugin's options (or
        ``schema.add(Option(...))`` for each). Every option is both a TOML key and a command-line
        flag of the same name (``max-batch`` / ``--max-batch``), validated at startup with an
        error naming the key and the file. The plugin reads them back typed with
        ``OPTIONS.of(config)``, ``OPTIONS.of(model)`` or ``OPTIONS.of(settings)`` (its
        model-scoped ones, also in ``settings.extra``); it reads no other plugin's option."""


@hookspec
def superfluid_add_models(register: ModelRegistrar, config: Config) -> None:
    """Add models to serve beside the configured ones: ``register(name, path, values)``.

    Called after the configuration is validated and before :func:`superfluid_configure`, so the
    checks see every model.

    :param register: ``register(name, path, values=None)`` adds the model ``name`` (a name
        already taken is a :class:`~superfluid.core.errors.ConfigError`) served from ``path``,
        and returns its :class:`~superfluid.core.config.ModelConfig`. ``values`` sets
        model-scoped options by key: the core's (``engine``, ``max-batch``, ``max-context``...)
        and the plugin's own, validated as a ``[[models]]`` table's are. Every other
        model-scoped option takes the first configured model's value, or its declared default
        where its owner declared it ``inherit=False`` (the qos plugin's ``class-lanes``).
    :param config: the validated configuration; ``config.models`` are the models so far."""


@hookspec
def superfluid_configure(config: Config) -> None:
    """Check the validated configuration once, before any engine loads.

    :param config: the whole :class:`~superfluid.core.config.Config`, with the models
        :func:`superfluid_add_models` added.
    Raise :class:`~superfluid.core.errors.ConfigError` to refuse it."""


@hookspec
def superfluid_add_engines(register: Callable[[str, EngineFactory], None]) -> None:
    """Register engine adapters: ``register("name", factory)``.

    :param register: takes the name a model's ``engine`` key selects and a factory;
        ``factory(model=ModelConfig, config=Config)`` returns an unstarted
        :class:`~superfluid.core.engine.Engine`. A name registered twice is an error."""


@hookspec
def superfluid_add_chat_formats(register: Callable[[ToolFormat | ReasoningFormat | NamedTemplate], None]) -> None:
    """Register chat formats: how a model family writes tool calls and reasoning, and chat
    templates a model can be given by name.

    :param register: takes a :class:`~superfluid.core.formats.family.ToolFormat` (a family's
        tool-call syntax: how its template is recognised, how calls are read from a reply and
        how one is written for a forced call), a
        :class:`~superfluid.core.formats.family.ReasoningFormat` (a thinking span's markers) or
        a :class:`~superfluid.core.formats.setup.NamedTemplate` (a Jinja template for
        ``chat-template NAME``). A model's ``tool-call-parser`` and ``reasoning-parser`` options
        select formats by name; ``auto`` detects them from the model's chat template (the
        highest score wins). A name registered twice among things of its kind is an error.
        Called once on the main thread at startup (and by ``superfluid template``)."""


@hookspec
def superfluid_add_pressure_sources(register: Callable[[PressureSource], None], config: Config) -> None:
    """Register memory pressure sources: ``register(source)``.

    :param register: takes an object with ``level() -> "ok" | "warning" | "critical"``
        (:class:`~superfluid.core.pressure.PressureSource`), read on each model's thread
        between ticks, at most every half second.
    :param config: the configuration, to honour a plugin's own on/off option."""


@hookspec
def superfluid_add_commands(register: Callable[[str, str, Callable, Callable], None]) -> None:
    """Register ``superfluid`` subcommands: ``register(name, help, add_arguments, run)``.

    :param register: takes the subcommand's name (not ``serve``), a one-line help,
        ``add_arguments(parser)`` to declare its arguments on an ``argparse`` parser, and
        ``run(args) -> int`` (the exit status). Called on the main thread when the command line
        is parsed."""


@hookspec
def superfluid_add_frontends(register: Callable[[object], None], config: Config, daemon: Daemon) -> None:
    """Register front ends: ``register(frontend)``, an object with ``async start()`` and
    ``async stop()``, run on the daemon's event loop.

    :param config: the configuration.
    :param daemon: the :class:`~superfluid.core.daemon.Daemon`: its models, their loops and
        their engines' tokenizers."""


# ---- scheduling decisions (the model's thread, its lock held) -------------------------------
# A model needs an implementation of pick_next, choose_victim and plan_tick: the daemon refuses
# to start without one (the qos plugin provides all three).

@hookspec(firstresult=True)
def superfluid_pick_next(queue: list[Lane], lanes: list[Lane], now: float, settings: SchedulerSettings,
                         free_lanes: int, pressure: str) -> Lane | None:
    """Choose the next queued lane to admit, or None to admit nothing now.

    :param queue: queued lanes that may be admitted now, in arrival order (requeued lanes at the
        head of their class); lanes waiting to copy a prefix another lane is prefilling are left
        out.
    :param lanes: the running lanes.
    :param now: ``time.monotonic()`` at the start of planning.
    :param settings: the model's settings; a plugin's own options are ``OPTIONS.of(settings)``.
    :param free_lanes: free lanes now. With none free, the chosen lane is admitted only if
        :func:`superfluid_choose_victim` names a lane to preempt for it. A chosen lane of a class
        that is not urgent also waits for the next tick when this tick already moves
        ``PARK_TOKENS_PER_TICK`` tokens of evicted KV to host memory (``core/kv_room.py``).
    :param pressure: the worst OS memory pressure level now: "ok", "warning" or "critical".

    Called once per admitted lane per tick: keep it fast."""


@hookspec(firstresult=True)
def superfluid_choose_victim(lane: Lane, lanes: list[Lane], settings: SchedulerSettings) -> Lane | None:
    """Choose a running lane to preempt so that queued ``lane`` can start, or None for none.

    :param lane: the lane :func:`superfluid_pick_next` chose, with no lane (or no KV room)
        free for it.
    :param lanes: the running lanes. A pinned lane (``lane.pinned``) is never preempted: naming
        one preempts nothing.
    :param settings: the model's settings."""


@hookspec(firstresult=True)
def superfluid_plan_tick(lanes: list[Lane], queue: list[Lane], costs: CostModel,
                         capabilities: EngineCapabilities, settings: SchedulerSettings,
                         now: float) -> TickPlan | None:
    """Return a :class:`~superfluid.core.tick.TickPlan` for the running ``lanes``: their
    prefill chunks and decode grants, and the tick's target length.

    :param lanes: the running lanes (at least one).
    :param queue: the lanes still queued after admission (whether a tick may run long).
    :param costs: measured seconds per prefill token and per decode round.
    :param capabilities: what the engine declared (:class:`~superfluid.core.engine.EngineCapabilities`).
    :param settings: the model's settings.
    :param now: ``time.monotonic()`` at the start of planning."""


@hookspec(firstresult=True)
def superfluid_pressure_victims(level: str, lanes: list[Lane], settings: SchedulerSettings) -> list[Lane] | None:
    """OS memory pressure was just read as ``level`` ("warning" or "critical"), after the KV
    manager evicted cached prefixes: return running lanes to preempt as well (pinned lanes are
    skipped), or None for none.

    :param lanes: the running lanes.
    :param settings: the model's settings."""


@hookspec(firstresult=True)
def superfluid_should_stop_tick(lane: Lane, lanes: list[Lane], settings: SchedulerSettings) -> bool | None:
    """A request was just queued while lanes run: return True to end the tick in flight at the
    engine's next step (for example, interactive work arriving).

    Runs on the thread that submitted the request (a front end's), with the model's lock held.

    :param lane: the lane just queued.
    :param lanes: the running lanes.
    :param settings: the model's settings."""


# ---- observers (the model's thread, after each tick) ----------------------------------------

@hookspec
def superfluid_tick_done(model: str, stats: TickStats) -> None:
    """After every tick, outside the model's lock.

    :param model: the model's name.
    :param stats: what the tick did (:class:`~superfluid.core.stats.TickStats`). Keep it cheap:
        the next tick waits for every observer (metrics, logs)."""


@hookspec
def superfluid_lane_finished(model: str, lane: Lane) -> None:
    """Once per lane when it finishes, is cancelled or fails, on the model's thread with its lock
    held (or on the thread that cancels a queued lane or closes the model).

    :param model: the model's name.
    :param lane: the lane; ``lane.finish_reason`` says how it ended."""
