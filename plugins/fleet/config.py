"""The fleet head's configuration: the ``[fleet]`` table of a TOML file, then flags over it,
through the same option machinery as ``superfluid serve`` (:mod:`superfluid.core.config`: one
:class:`Option` per key and flag, validated with errors that name the key or flag and the file).

The head has no local scheduler, so the spec has it refuse the four options that configure one
(``--class-lanes``, ``--http-default-qos``, ``--no-http-qos-header``,
``--http-allow-batch-invariant``), as flags and as ``[fleet]`` keys: a user who sets them on the
head expects an effect it cannot have, so a clear error that points at each node's own
``superfluid serve`` beats silently ignoring them. They are a node's settings (the qos and HTTP
plugins'), named here only to be refused: the head reads none. Errors name the key (or flag) and
the file."""

from __future__ import annotations

import argparse
from typing import Any
from urllib.parse import urlsplit

import attrs

from superfluid.core.config import add_flags, option_values, read_toml
from superfluid.core.errors import ConfigError
from superfluid.core.options import Option, PluginOptions, Schema, in_range
from superfluid.core.tls import client_context, server_context

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


def refusal(flag: str) -> str:
    """The message for a refused local-scheduler option (the same for a flag and a key)."""
    return (f"{flag} is a node setting: the fleet head has no local scheduler; "
            f"set it on each node's own `superfluid serve`")


def _url(value: Any) -> tuple[str, str | None]:
    """(the URL normalised, the problem with it or None)."""
    if not isinstance(value, str):
        return "", f"must be a URL string such as http://127.0.0.1:8080, got {value!r}"
    url = value.strip().rstrip("/")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return url, f"must be an http:// or https:// URL such as http://127.0.0.1:8080, got {value!r}"
    try:
        parts.port
    except ValueError:
        return url, f"has a bad port: {value!r}"
    if parts.path or parts.query or parts.fragment:
        return url, f"must be a node's base URL (no path), got {value!r}"
    return url, None


def node_url(value: Any, where: str) -> str:
    """A node's base URL, normalised (no trailing slash): ``http(s)://host:port``."""
    url, problem = _url(value)
    if problem:
        raise ConfigError(f"{where} {problem}")
    return url


def _parse_node(text: str) -> str:
    url, problem = _url(text)
    if problem:
        raise ConfigError(problem)
    return url


def _one_of(choices: tuple[str, ...]):
    return lambda v: None if v in choices else f"must be one of {', '.join(choices)}"


def _non_empty(value: str) -> str | None:
    return None if value else "must be a non-empty string"


OPTIONS = PluginOptions("fleet", [
    Option("nodes", list, [], "a node's base URL (a `superfluid serve`), repeatable; TOML: nodes = [...]",
           parse=_parse_node, metavar="URL", flag="node"),
    Option("discovery-file", str, None, "JSON file listing the nodes, reread when it changes: "
           '{"version": 1, "workers": [{"url": "http://host:port"}]} (SMG\'s manifest format)',
           _non_empty, metavar="FILE"),
    Option("host", str, "127.0.0.1", "address to listen on", _non_empty, metavar="ADDR"),
    Option("port", int, 8000, "port to listen on", in_range(0, 65535), metavar="PORT"),
    Option("policy", str, "cache_aware", f"SMG's routing policy: {', '.join(POLICIES)}", _one_of(POLICIES),
           metavar="NAME", parse=str.lower),
    Option("smg-port", int, 0, "SMG's own port on 127.0.0.1, internal; 0 picks a free port", in_range(0, 65535),
           metavar="PORT"),
    Option("log-level", str, "info", "debug, info, warning or error", _one_of(LOG_LEVELS), metavar="LEVEL",
           parse=str.lower),
    Option("ssl-certfile", str, None, "serve the head over HTTPS with this PEM certificate (chain); needs "
           "--ssl-keyfile", _non_empty, metavar="FILE.pem"),
    Option("ssl-keyfile", str, None, "the PEM private key of --ssl-certfile (unencrypted)", _non_empty,
           metavar="FILE.pem"),
    Option("ssl-cafile", str, None, "PEM CA certificate(s) to verify https:// nodes with, besides the "
           "system's (the head and SMG both use it)", _non_empty, metavar="FILE.pem"),
])
"""``superfluid fleet``'s own options: a command's, not ``serve``'s (never declared to its schema)."""


def schema() -> Schema:
    out = Schema()
    OPTIONS.declare(out)
    return out


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
    ssl_certfile: str | None = None  # the head serves HTTPS with these two
    ssl_keyfile: str | None = None
    ssl_cafile: str | None = None  # what https:// nodes are verified with, besides the system's CAs


def _refuse_keys(table: dict, source: str) -> None:
    for raw_key in table:
        key = raw_key.replace("_", "-")
        for flag, spellings in REFUSED.items():
            if key in spellings:
                raise ConfigError(f"{source}: [fleet] {raw_key}: {refusal(flag)}")


def read_file(path: str) -> dict:
    """The ``[fleet]`` table of a TOML file (other tables, e.g. a node's, are not the head's),
    refused keys checked."""
    toml = read_toml(path)
    table = toml.get("fleet")
    if table is None:
        raise ConfigError(f"{path}: no [fleet] table")
    if not isinstance(table, dict):
        raise ConfigError(f"{path}: fleet must be a table ([fleet])")
    _refuse_keys(table, path)
    return table


def from_args(args: argparse.Namespace) -> FleetConfig:
    """Defaults < the ``--config`` file's ``[fleet]`` table < flags; refusals first."""
    for flag in REFUSED:
        if getattr(args, "refused_" + flag.lstrip("-").replace("-", "_"), None) is not None:
            raise ConfigError(refusal(flag))
    table, source = {}, "flags"
    if args.config:
        table, source = read_file(args.config), args.config
    options = schema()
    values = option_values(options, table, {o.dest: getattr(args, o.dest, None) for o in options},
                           f"{source}: [fleet] ")
    opts = OPTIONS.of(values)
    config = FleetConfig(nodes=tuple(opts.nodes), discovery_file=opts.discovery_file, host=opts.host,
                         port=opts.port, policy=opts.policy, smg_port=opts.smg_port, log_level=opts.log_level,
                         source=source, ssl_certfile=opts.ssl_certfile, ssl_keyfile=opts.ssl_keyfile,
                         ssl_cafile=opts.ssl_cafile)
    try:  # both or neither, readable, a matching pair; a CA file that parses
        server_context(config.ssl_certfile, config.ssl_keyfile)
        client_context(config.ssl_cafile)
    except ConfigError as exc:
        raise ConfigError(f"{source}: {exc}") from None
    if not config.nodes and not config.discovery_file:
        raise ConfigError(f"{source}: no nodes: give --node URL (repeatable), nodes = [...] in [fleet], "
                          f"or --discovery-file FILE")
    if len(set(config.nodes)) != len(config.nodes):
        raise ConfigError(f"{source}: a node is listed twice: {list(config.nodes)}")
    return config


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="FILE.toml", help="TOML file with a [fleet] table (flags override it)")
    add_flags(parser, schema())
    # Refused (node settings): accepted by the parser so the error can name them.
    for flag in REFUSED:
        dest = "refused_" + flag.lstrip("-").replace("-", "_")
        if flag in ("--no-http-qos-header", "--http-allow-batch-invariant"):
            parser.add_argument(flag, dest=dest, action="store_const", const=True, default=None,
                                help=argparse.SUPPRESS)
        else:
            parser.add_argument(flag, dest=dest, nargs="?", const="", default=None, help=argparse.SUPPRESS)
