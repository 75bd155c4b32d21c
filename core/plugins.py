"""The plugin manager: built-in and third-party plugins load the same way.

Every plugin registers through the ``superfluid`` entry-point group; the TOML ``plugins`` key
adds modules by import name (registered last, so their decision hooks win)."""

from __future__ import annotations

import importlib
import logging
import os

import pluggy

from . import hookspecs
from .errors import ConfigError

log = logging.getLogger("superfluid.plugins")

ENTRY_POINT_GROUP = "superfluid"
# Decisions every model needs: without an implementation no tick can be planned.
REQUIRED_HOOKS = ("superfluid_pick_next", "superfluid_choose_victim", "superfluid_plan_tick")


def check_required_hooks(pm: pluggy.PluginManager) -> None:
    """Refuse to start without a plugin for each decision a model needs (a clear error now
    rather than a failed first tick)."""
    missing = [name for name in REQUIRED_HOOKS  # a wrapper (fair-share's) only adjusts an answer
               if not any(not (i.wrapper or i.hookwrapper) for i in getattr(pm.hook, name).get_hookimpls())]
    if missing:
        raise ConfigError(f"no plugin implements {', '.join(missing)}: the built-in qos plugin provides "
                          "them; is it installed, or disabled in the configuration's plugins?")


def make_plugin_manager(extra: list[str] | tuple[str, ...] = (), *,
                        disabled: list[str] | tuple[str, ...] = (),
                        source: str = "configuration") -> pluggy.PluginManager:
    pm = pluggy.PluginManager("superfluid")
    pm.add_hookspecs(hookspecs)
    for name in disabled:
        pm.set_blocked(name)
    pm.load_setuptools_entrypoints(ENTRY_POINT_GROUP)
    for name in extra:
        if pm.has_plugin(name) or pm.is_blocked(name):
            continue
        try:
            module = importlib.import_module(name)
        except ImportError as exc:
            raise ConfigError(f"plugins: cannot import {name!r} (in {source}): {exc}") from exc
        pm.register(module, name)
    if os.environ.get("SUPERFLUID_TRACE_HOOKS"):
        trace_log = logging.getLogger("superfluid.hooks")
        pm.trace.root.setwriter(lambda msg: trace_log.info(msg.rstrip()))
        pm.enable_tracing()
    log.debug("plugins: %s", ", ".join(n for n, _ in pm.list_name_plugin()))
    return pm
