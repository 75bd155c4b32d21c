"""``superfluid keys new NAME [--class C] [--file F]``: add an API key to a key policy file.

The secret goes to stdout, alone, so a script can capture it; what to do with it goes to stderr.
The secret itself is stored nowhere: only its SHA-256 is written (``keys.policy.new_key``)."""

from __future__ import annotations

import argparse
import sys

from superfluid.core.errors import ConfigError

DEFAULT_KEY_FILE = "keys.toml"
HELP = "manage the API keys of a --key-policy file"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="keys_command", required=True)
    new = sub.add_parser("new", help="make a random secret, print it once and write its hash into the file",
                         description="The secret itself is stored nowhere; a lost one is replaced by a new key.")
    new.add_argument("name", metavar="NAME", help="the key's name (letters, digits, '-', '_'); logs name keys by it")
    new.add_argument("--class", dest="qos_class", default="agent", metavar="C",
                     help="the highest QoS class the key may use, and its default (default: agent)")
    new.add_argument("--file", default=DEFAULT_KEY_FILE, metavar="F",
                     help=f"the key policy file, created if missing (default: {DEFAULT_KEY_FILE})")


def run(args: argparse.Namespace) -> int:
    from ..keys.policy import new_key
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
