"""The default scheduling policies: class-ordered admission with aging and lane caps,
preemption for urgent classes, and tick planning.

Each is an ordinary ``firstresult`` hook implementation; a plugin listed in the TOML ``plugins``
key replaces any one of them."""

from __future__ import annotations

from superfluid.core import qos
from superfluid.core.hookspecs import hookimpl

from . import admission, options, planner


@hookimpl
def superfluid_add_config(schema):
    options.OPTIONS.declare(schema)


@hookimpl
def superfluid_configure(config):
    options.check_caps(config)


@hookimpl
def superfluid_pick_next(queue, lanes, now, settings, free_lanes, pressure):
    return admission.pick_next(queue, lanes, settings, free_lanes, pressure)


@hookimpl
def superfluid_choose_victim(lane, lanes, settings):
    return admission.choose_victim(lane, lanes)


@hookimpl
def superfluid_plan_tick(lanes, queue, costs, capabilities, settings, now):
    return planner.plan_tick(lanes, queue, costs, capabilities, settings)


@hookimpl
def superfluid_pressure_victims(level, lanes, settings):
    return admission.pressure_victims(level, lanes)


@hookimpl
def superfluid_should_stop_tick(lane, lanes, settings):
    return lane.qos in qos.URGENT
