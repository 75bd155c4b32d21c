"""``superfluid serve``: parse the TOML file and flags, load the models, run the front ends."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from . import __version__
from .config import Schema, add_flags, build_config, core_options, read_toml
from .daemon import Daemon, print_progress
from .errors import ConfigError, SuperfluidError
from .plugins import make_plugin_manager


def _pre_parse(argv: list[str]) -> tuple[str | None, dict]:
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config")
    known, _ = pre.parse_known_args(argv)
    toml = read_toml(known.config) if known.config else {}
    return known.config, toml


def build_parser(schema: Schema) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="superfluid", description="QoS-aware LLM serving daemon")
    parser.add_argument("--version", action="version", version=f"superfluid {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve models over the OpenAI HTTP API",
                           description="Every option is also a TOML key of the same name; flags override the file.")
    serve.add_argument("--config", metavar="FILE.toml", help="TOML configuration file")
    add_flags(serve, schema)
    return parser


def load(argv: list[str]):
    """(config, plugin manager) from argv: TOML first (it names extra plugins), then flags."""
    if argv and argv[0] == "serve":
        path, toml = _pre_parse(argv[1:])
    else:
        path, toml = None, {}
    source = path or "defaults"
    pm = make_plugin_manager(toml.get("plugins", []) if isinstance(toml.get("plugins"), list) else [],
                             source=source)
    schema = Schema()
    for opt in core_options():
        schema.add(opt)
    pm.hook.superfluid_add_config(schema=schema)
    args = build_parser(schema).parse_args(argv)
    flags = {k: v for k, v in vars(args).items() if k not in ("command", "config")}
    config = build_config(schema, toml, flags, source=source)
    pm.hook.superfluid_configure(config=config)
    return config, pm


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        config, pm = load(argv)
    except ConfigError as exc:
        print(f"superfluid: configuration error: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=config["log-level"].upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
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
