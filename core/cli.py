"""``superfluid serve``: parse the TOML file and flags, load the models, run the front ends.
``superfluid keys new NAME``: add an API key to a key policy file (the secret is printed once)."""

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
    _add_keys_parser(sub)
    return parser


DEFAULT_KEY_FILE = "keys.toml"


def _add_keys_parser(sub) -> None:
    keys = sub.add_parser("keys", help="manage the API keys of a --key-policy file")
    ksub = keys.add_subparsers(dest="keys_command", required=True)
    new = ksub.add_parser("new", help="make a random secret, print it once and write its hash into the file",
                          description="The secret itself is stored nowhere; a lost one is replaced by a new key.")
    new.add_argument("name", metavar="NAME", help="the key's name (letters, digits, '-', '_'); logs name keys by it")
    new.add_argument("--class", dest="qos_class", default="agent", metavar="C",
                     help="the highest QoS class the key may use, and its default (default: agent)")
    new.add_argument("--file", default=DEFAULT_KEY_FILE, metavar="F",
                     help=f"the key policy file, created if missing (default: {DEFAULT_KEY_FILE})")


def keys_main(argv: list[str]) -> int:
    """``superfluid keys new NAME [--class C] [--file F]``: the secret on stdout, alone, so a
    script can capture it; what to do with it on stderr."""
    parser = argparse.ArgumentParser(prog="superfluid")
    _add_keys_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["keys", *argv])
    from superfluid.plugins.http.keys import new_key  # the policy's format is the HTTP front end's
    try:
        secret = new_key(args.file, args.name, args.qos_class)
    except ConfigError as exc:
        print(f"superfluid: {exc}", file=sys.stderr)
        return 2
    print(secret, flush=True)
    print(f"superfluid: key {args.name!r} ({args.qos_class}) added to {args.file}; the secret above is shown "
          f"only now. Send it as 'Authorization: Bearer <secret>'; SIGHUP a running server to load it.",
          file=sys.stderr)
    return 0


def open_door(config) -> str | None:
    """Why ``serve`` must refuse this configuration before loading anything (None: it may go on)."""
    if "host" not in config.values:  # no HTTP front end
        return None
    from superfluid.plugins.http.auth import open_door as refusal
    return refusal(config.get("host"), config.get("key-policy"), bool(config.get("insecure")))


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
    if argv and argv[0] == "keys":
        return keys_main(argv[1:])
    try:
        config, pm = load(argv)
        refusal = open_door(config)
    except ConfigError as exc:
        print(f"superfluid: configuration error: {exc}", file=sys.stderr)
        return 2
    if refusal:  # before any model loads: an exposed server with no keys never starts
        print(f"superfluid: refusing to start: {refusal}", file=sys.stderr)
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
