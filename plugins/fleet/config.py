"""The fleet head's configuration: the ``[fleet]`` table of a TOML file, then flags over it.

The head has no local scheduler, so the spec has it refuse the four options that configure one
(``--class-lanes``, ``--http-default-qos``, ``--no-http-qos-header``,
``--http-allow-batch-invariant``), as flags and as ``[fleet]`` keys: a user who sets them on the
head expects an effect it cannot have, so a clear error that points at each node's own
``superfluid serve`` beats silently ignoring them. Errors name the key (or flag) and the file."""

from __future__ import annotations

import argparse
from typing import Any
from urllib.parse import urlsplit

import attrs

from superfluid.core.config import read_toml
from superfluid.core.errors import ConfigError

# SMG's routing policies (``smg launch --policy``), minus the ones that need something the head
# does not give SMG: ``manual`` (a routing-key header per request), ``passthrough``.
POLICIES = ("cache_aware", "round_robin", "power_of_two", "prefix_hash", "consistent_hashing",
            "least_load", "random")
LOG_LEVELS = ("debug", "info", "warning", "error")

# flag -> the [fleet] key spellings that mean the same; all are node settings.
REFUSED = {
    "--class-lanes": ("class-lanes",),
    "--http-default-qos": ("http-default-qos",),
    "--no-http-qos-header": ("no-http-qos-header", "http-qos-header"),
    "--http-allow-batch-invariant": ("http-allow-batch-invariant",),
}
KEYS = ("nodes", "discovery-file", "host", "port", "policy", "smg-port", "log-level")


def refusal(flag: str) -> str:
    """The message for a refused local-scheduler option (the same for a flag and a key)."""
    return (f"{flag} is a node setting: the fleet head has no local scheduler; "
            f"set it on each node's own `superfluid serve`")


@attrs.define(frozen=True)
class FleetConfig:
    """What ``superfluid fleet`` runs with, validated."""

    nodes: tuple[str, ...] = ()
    discovery_file: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    policy: str = "cache_aware"
    smg_port: int = 0  # 0: a free port, chosen at start
    log_level: str = "info"
    source: str = "flags"


def node_url(value: Any, where: str) -> str:
    """A node's base URL, normalised (no trailing slash): ``http(s)://host:port``."""
    if not isinstance(value, str):
        raise ConfigError(f"{where} must be a URL string such as http://127.0.0.1:8080, got {value!r}")
    url = value.strip().rstrip("/")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"{where} must be an http:// or https:// URL such as http://127.0.0.1:8080, got {value!r}")
    try:
        parts.port
    except ValueError:
        raise ConfigError(f"{where} has a bad port: {value!r}") from None
    if parts.path or parts.query or parts.fragment:
        raise ConfigError(f"{where} must be a node's base URL (no path), got {value!r}")
    return url


def _port(value: Any, where: str, allow_zero: bool) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{where} must be an integer port, got {value!r}")
    lo = 0 if allow_zero else 1
    if not lo <= value <= 65535:
        raise ConfigError(f"{where} must be between {lo} and 65535, got {value!r}")
    return value


def _choice(value: Any, where: str, choices: tuple[str, ...]) -> str:
    if not isinstance(value, str) or value.lower() not in choices:
        raise ConfigError(f"{where} must be one of {', '.join(choices)}, got {value!r}")
    return value.lower()


def _string(value: Any, where: str) -> str:
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{where} must be a non-empty string, got {value!r}")
    return value


def from_table(table: dict, source: str) -> dict[str, Any]:
    """The ``[fleet]`` table's values, checked, keyed by :class:`FleetConfig` field."""
    out: dict[str, Any] = {}
    for raw_key, value in table.items():
        key = raw_key.replace("_", "-")
        where = f"{source}: [fleet] {raw_key}"
        for flag, spellings in REFUSED.items():
            if key in spellings:
                raise ConfigError(f"{source}: [fleet] {raw_key}: {refusal(flag)}")
        if key not in KEYS:
            raise ConfigError(f"{source}: [fleet]: unknown key {raw_key!r} (known: {', '.join(KEYS)})")
        if key == "nodes":
            if not isinstance(value, list):
                raise ConfigError(f"{where} must be a list of node URLs, got {value!r}")
            out["nodes"] = tuple(node_url(v, f"{where}[{i}]") for i, v in enumerate(value))
        elif key == "discovery-file":
            out["discovery_file"] = _string(value, where)
        elif key == "host":
            out["host"] = _string(value, where)
        elif key == "port":
            out["port"] = _port(value, where, allow_zero=True)
        elif key == "smg-port":
            out["smg_port"] = _port(value, where, allow_zero=True)
        elif key == "policy":
            out["policy"] = _choice(value, where, POLICIES)
        elif key == "log-level":
            out["log_level"] = _choice(value, where, LOG_LEVELS)
    return out


def read_file(path: str) -> dict[str, Any]:
    """The ``[fleet]`` table of a TOML file (other tables, e.g. a node's, are not the head's)."""
    toml = read_toml(path)
    table = toml.get("fleet")
    if table is None:
        raise ConfigError(f"{path}: no [fleet] table")
    if not isinstance(table, dict):
        raise ConfigError(f"{path}: fleet must be a table ([fleet])")
    return from_table(table, path)


def from_args(args: argparse.Namespace) -> FleetConfig:
    """Defaults < the ``--config`` file's ``[fleet]`` table < flags; refusals first."""
    for flag in REFUSED:
        if getattr(args, "refused_" + flag.lstrip("-").replace("-", "_"), None) is not None:
            raise ConfigError(refusal(flag))
    values: dict[str, Any] = {}
    source = "flags"
    if args.config:
        values.update(read_file(args.config))
        source = args.config
    if args.node:
        values["nodes"] = tuple(node_url(v, "--node") for v in args.node)
    if args.discovery_file is not None:
        values["discovery_file"] = _string(args.discovery_file, "--discovery-file")
    if args.host is not None:
        values["host"] = _string(args.host, "--host")
    if args.port is not None:
        values["port"] = _port(args.port, "--port", allow_zero=True)
    if args.smg_port is not None:
        values["smg_port"] = _port(args.smg_port, "--smg-port", allow_zero=True)
    if args.policy is not None:
        values["policy"] = _choice(args.policy, "--policy", POLICIES)
    if args.log_level is not None:
        values["log_level"] = _choice(args.log_level, "--log-level", LOG_LEVELS)
    config = FleetConfig(source=source, **values)
    if not config.nodes and not config.discovery_file:
        raise ConfigError(f"{source}: no nodes: give --node URL (repeatable), nodes = [...] in [fleet], "
                          f"or --discovery-file FILE")
    if len(set(config.nodes)) != len(config.nodes):
        raise ConfigError(f"{source}: a node is listed twice: {list(config.nodes)}")
    return config


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="FILE.toml", help="TOML file with a [fleet] table (flags override it)")
    parser.add_argument("--node", action="append", metavar="URL",
                        help="a node's base URL (a `superfluid serve`), repeatable; TOML: nodes = [...]")
    parser.add_argument("--discovery-file", metavar="FILE",
                        help="JSON file listing the nodes, reread when it changes: "
                             '{"version": 1, "workers": [{"url": "http://host:port"}]} (SMG\'s manifest format)')
    parser.add_argument("--host", metavar="ADDR", help="address to listen on (default: 127.0.0.1)")
    parser.add_argument("--port", type=int, metavar="PORT", help="port to listen on (default: 8000)")
    parser.add_argument("--policy", metavar="NAME",
                        help=f"SMG's routing policy: {', '.join(POLICIES)} (default: cache_aware)")
    parser.add_argument("--smg-port", type=int, metavar="PORT",
                        help="SMG's own port on 127.0.0.1, internal (default: a free port)")
    parser.add_argument("--log-level", metavar="LEVEL", help="debug, info, warning or error (default: info)")
    # Refused (node settings): accepted by the parser so the error can name them.
    for flag in REFUSED:
        dest = "refused_" + flag.lstrip("-").replace("-", "_")
        if flag in ("--no-http-qos-header", "--http-allow-batch-invariant"):
            parser.add_argument(flag, dest=dest, action="store_const", const=True, default=None,
                                help=argparse.SUPPRESS)
        else:
            parser.add_argument(flag, dest=dest, nargs="?", const="", default=None, help=argparse.SUPPRESS)
