"""The hook specifications: Superfluid's public plugin API.

Grouped by phase. Decision hooks are ``firstresult``: the first plugin that answers (not None)
wins, so a plugin listed in the TOML ``plugins`` key, registered after the built-ins, overrides
them (pluggy calls later-registered plugins first). Observer hooks call every plugin.

Set ``SUPERFLUID_TRACE_HOOKS=1`` to log every hook call and its result.
"""

from __future__ import annotations

import pluggy

hookspec = pluggy.HookspecMarker("superfluid")
hookimpl = pluggy.HookimplMarker("superfluid")


# ---- startup: configuration and registries -------------------------------------------------

@hookspec
def superfluid_add_config(schema):
    """Declare configuration options.

    Call ``schema.add(Option(...))`` for each option the plugin reads. Every option is both a
    TOML key and a command-line flag of the same name (``max-batch`` / ``--max-batch``), and is
    validated at startup with an error naming the key and the file."""


@hookspec
def superfluid_configure(config):
    """Called once with the validated :class:`~superfluid.core.config.Config`, before any
    engine loads. Raise :class:`~superfluid.core.errors.ConfigError` to refuse it."""


@hookspec
def superfluid_add_engines(registry):
    """Register engine adapter factories: ``registry.add("name", factory)``.

    ``factory(model=ModelConfig, config=Config)`` returns an unstarted
    :class:`~superfluid.core.engine.Engine`."""


# ---- scheduling decisions (called on the model's scheduler thread) ----------------------------

@hookspec(firstresult=True)
def superfluid_pick_next(queue, lanes, now, settings):
    """Choose the next queued lane to admit, or return None to admit nothing now.

    ``queue`` is the list of queued lanes in arrival order (requeued lanes at the head of their
    class), ``lanes`` the running ones, ``settings`` the model's
    :class:`~superfluid.core.scheduler.SchedulerSettings`. Must be fast: it runs once per free
    lane per tick."""


@hookspec(firstresult=True)
def superfluid_choose_victim(lane, lanes, settings):
    """Choose a running lane to preempt so that queued ``lane`` can start, or None for no
    preemption."""


@hookspec(firstresult=True)
def superfluid_plan_tick(lanes, queue, costs, capabilities, settings, now):
    """Return a :class:`~superfluid.core.tick.TickPlan` for the running ``lanes``.

    ``costs`` is the model's :class:`~superfluid.core.costs.CostModel` (measured seconds per
    prefill token and per decode round); ``capabilities`` the engine's
    :class:`~superfluid.core.engine.EngineCapabilities`. The plan decides prefill chunks,
    decode grants and the tick's target length."""


@hookspec(firstresult=True)
def superfluid_should_stop_tick(lane, lanes, settings):
    """A request was just queued while a tick runs: return True to end that tick at the
    engine's next step (for example, interactive work arriving)."""


# ---- memory pressure -----------------------------------------------------------------------

@hookspec
def superfluid_pressure_sources(config):
    """Return pressure sources (objects with ``level() -> "ok" | "warning" | "critical"``)."""


# ---- front ends ------------------------------------------------------------------------------

@hookspec
def superfluid_frontends(config, daemon):
    """Return front ends to run: objects with ``async start()`` and ``async stop()``.

    ``daemon`` is the :class:`~superfluid.core.daemon.Daemon`: its models, their schedulers
    and engines' tokenizers."""


# ---- observers -------------------------------------------------------------------------------

@hookspec
def superfluid_tick_done(model, stats):
    """Called after every tick with a :class:`~superfluid.core.scheduler.TickStats`.

    Runs on the scheduler thread between ticks: keep it cheap (metrics, logs)."""


@hookspec
def superfluid_lane_finished(model, lane):
    """Called once per lane when it finishes, is cancelled or fails (on the scheduler thread)."""
