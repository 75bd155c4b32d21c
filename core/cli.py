"""``superfluid serve``: parse the TOML file and flags, load the models, run the front ends.
Plugins add other subcommands through ``superfluid_add_commands`` (the HTTP front end's
``superfluid keys new NAME``)."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Callable

import attrs

from . import __version__, plugin_report
from .config import CORE_OPTIONS, Schema, add_flags, build_config, model_registrar, read_toml
from .errors import ConfigError, SuperfluidError
from .plugins import make_plugin_manager


def _pre_parse(argv: list[str]) -> tuple[str | None, dict]:
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config")
    known, _ = pre.parse_known_args(argv)
    toml = read_toml(known.config) if known.config else {}
    return known.config, toml


def build_parser(schema: Schema, commands: dict[str, Command] | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="superfluid", description="QoS-aware LLM serving daemon")
    parser.add_argument("--version", action="version", version=f"superfluid {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve models over the OpenAI HTTP API",
                           description="Every option is also a TOML key of the same name; flags override the file.")
    serve.add_argument("--config", metavar="FILE.toml", help="TOML configuration file")
    add_flags(serve, schema)
    for command in (commands or {}).values():
        command.add_arguments(sub.add_parser(command.name, help=command.help, description=command.help))
    return parser


@attrs.define(frozen=True)
class Command:
    """A subcommand a plugin adds (``superfluid_add_commands``)."""

    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


def plugin_commands(pm) -> dict[str, Command]:
    commands: dict[str, Command] = {"plugins": Command("plugins", plugin_report.HELP, plugin_report.add_arguments,
                                                       plugin_report.run)}  # the core's own

    def register(name: str, help: str, add_arguments, run) -> None:
        if name == "serve" or name in commands:
            raise ValueError(f"command {name!r} registered twice")
        commands[name] = Command(name, help, add_arguments, run)

    pm.hook.superfluid_add_commands(register=register)
    return commands


def load(argv: list[str]):
    """(config, plugin manager) from argv: TOML first (it names extra plugins), then flags."""
    if argv and argv[0] == "serve":
        path, toml = _pre_parse(argv[1:])
    else:
        path, toml = None, {}
    source = path or "defaults"
    pm = make_plugin_manager(toml.get("plugins", []) if isinstance(toml.get("plugins"), list) else [],
                             source=source)
    schema = declare_options(pm)
    args = build_parser(schema, plugin_commands(pm)).parse_args(argv)
    flags = {k: v for k, v in vars(args).items() if k not in ("command", "config")}
    config = build_config(schema, toml, flags, source=source)
    pm.hook.superfluid_add_models(register=model_registrar(config), config=config)
    pm.hook.superfluid_configure(config=config)
    return config, pm


def declare_options(pm) -> Schema:
    """The core's options and every plugin's (``superfluid_add_config``, called one plugin at a
    time in the hook's order, so the schema knows who declared each option)."""
    schema = Schema()
    CORE_OPTIONS.declare(schema)
    impls = pm.hook.superfluid_add_config.get_hookimpls()
    for impl in reversed(impls):  # pluggy calls the last registered first
        others = [i.plugin for i in impls if i.plugin is not impl.plugin]
        with schema.declaring(impl.plugin_name):
            pm.subset_hook_caller("superfluid_add_config", remove_plugins=others)(schema=schema)
    return schema


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and not argv[0].startswith("-") and argv[0] != "serve":  # a plugin's command
        pm = make_plugin_manager()
        commands = plugin_commands(pm)
        args = build_parser(declare_options(pm), commands).parse_args(argv)
        return commands[args.command].run(args)
    try:
        config, pm = load(argv)  # plugins refuse a configuration here, before any model loads
    except ConfigError as exc:
        print(f"superfluid: configuration error: {exc}", file=sys.stderr)
        return 2
    # imported here, not at the top: multiprocessing re-imports the entry module in every worker
    # it spawns, and a worker needs none of the daemon's modules (a tenth of a second of each start)
    import asyncio

    from . import lane_guard
    from .daemon import Daemon, print_progress

    logging.basicConfig(level=CORE_OPTIONS.of(config).log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    lane_guard.install_from_environment()  # SUPERFLUID_LANE_GUARD: the tests' lane-ownership check
    daemon = None
    try:
        daemon = Daemon(config, pm)
        daemon.load_models(progress=print_progress)
        asyncio.run(daemon.serve())
    except (ConfigError, SuperfluidError) as exc:
        print(f"superfluid: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        pass
    finally:
        if daemon is not None:
            daemon.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
