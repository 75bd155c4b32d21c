"""The default scheduling policies: class-ordered admission with aging, and tick planning.

Each is an ordinary ``firstresult`` hook implementation; a plugin listed in the TOML ``plugins``
key replaces any one of them."""

from __future__ import annotations

from superfluid.core import qos
from superfluid.core.hookspecs import hookimpl

from . import admission, planner


@hookimpl
def superfluid_pick_next(queue, lanes, now, settings):
    return admission.pick_next(queue, lanes, settings)


@hookimpl
def superfluid_plan_tick(lanes, queue, costs, capabilities, settings, now):
    return planner.plan_tick(lanes, queue, costs, capabilities, settings)


@hookimpl
def superfluid_should_stop_tick(lane, lanes, settings):
    return lane.qos in planner.URGENT
