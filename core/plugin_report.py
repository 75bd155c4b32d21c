"""``superfluid plugins``: every plugin that would load, where it came from and the hooks it
implements, so a plugin author can see that theirs is found and which decisions it takes part in.

Sources: **built-in** (an entry point of the ``superfluid`` distribution itself), **entry point**
(another installed distribution's, named with its version), **toml** (the configuration's
``plugins`` list). Decision hooks (``firstresult``: the first answer wins) are marked, and so are
hook wrappers (they see and may adjust the answer of the implementations below them)."""

from __future__ import annotations

import argparse
import json
import sys

from .config import read_toml
from .errors import ConfigError
from .plugins import make_plugin_manager

HELP = "list the loaded plugins, where each came from and the hooks it implements"
PREFIX = "superfluid_"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="FILE.toml", help="also load the file's `plugins` list")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def report(pm, toml_plugins=()) -> list[dict]:
    """One entry per registered plugin, in registration order (later ones answer decisions
    first)."""
    dists = {id(plugin): dist for plugin, dist in pm.list_plugin_distinfo()}
    out = []
    for name, plugin in pm.list_name_plugin():
        if plugin is None:  # blocked
            continue
        dist = dists.get(id(plugin))
        if dist is not None:
            dist_name = dist.metadata["name"]
            source = "built-in" if dist_name == "superfluid" else "entry point"
            where = {"distribution": dist_name, "version": dist.version}
        else:
            source = "toml" if name in toml_plugins else "registered"
            where = {"distribution": None, "version": None}
        hooks = []
        for caller in pm.get_hookcallers(plugin) or []:
            impl = next(i for i in caller.get_hookimpls() if i.plugin is plugin)
            spec = caller.spec.opts if caller.spec else {}
            hooks.append({"name": caller.name, "decision": bool(spec.get("firstresult")),
                          "wrapper": bool(impl.wrapper or impl.hookwrapper)})
        hooks.sort(key=lambda h: h["name"])
        out.append({"name": name, "module": getattr(plugin, "__name__", type(plugin).__name__),
                    "source": source, **where, "hooks": hooks})
    return out


def _hook_label(hook: dict) -> str:
    label = hook["name"].removeprefix(PREFIX)
    if hook["decision"]:
        label += "*"
    return label + (" (wrapper)" if hook["wrapper"] else "")


def table(entries: list[dict]) -> str:
    """A readable table: plugin, source, module, hooks (``*``: a decision hook)."""
    rows = [("plugin", "source", "module", "hooks")]
    for e in entries:
        source = e["source"]
        if e["source"] == "entry point":
            source = f"entry point of {e['distribution']} {e['version']}"
        rows.append((e["name"], source, e["module"], ", ".join(_hook_label(h) for h in e["hooks"]) or "-"))
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    lines = ["  ".join(r[i].ljust(widths[i]) for i in range(3)) + "  " + r[3] for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths) + "  " + "-" * 5)
    lines.append("")
    lines.append("hooks are named without their superfluid_ prefix; * marks a decision hook (firstresult: "
                 "the first answer wins, and the plugin registered last is asked first)")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    try:
        toml = read_toml(args.config) if args.config else {}
        plugins = toml.get("plugins", [])
        if not isinstance(plugins, list) or not all(isinstance(p, str) for p in plugins):
            raise ConfigError(f"{args.config}: plugins must be a list of module names")
        pm = make_plugin_manager(plugins, source=args.config or "defaults")
    except ConfigError as exc:
        print(f"superfluid: configuration error: {exc}", file=sys.stderr)
        return 2
    entries = report(pm, plugins)
    print(json.dumps({"plugins": entries}, indent=2) if args.json else table(entries))
    return 0
