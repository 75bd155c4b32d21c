"""The ``--kv-events`` endpoint and the topic, checked before anything loads.

The endpoint follows vLLM's ``--kv-events-config`` convention, so a deployment written for vLLM
works unchanged: a wildcard host (``tcp://*:5557``, also ``0.0.0.0`` or ``[::]``) or an
``ipc://`` path binds the PUB socket, and the indexer connects to every node (llm-d's pod
discovery, its default); any other host (``tcp://indexer:5557``) connects to an indexer that
binds (llm-d's static endpoint mode)."""

from __future__ import annotations

import ipaddress
import re
import socket

import attrs

DEFAULT_TOPIC = "kv@{host}:{port}@{model}"
_TCP = re.compile(r"^tcp://(?P<host>\*|\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]+):(?P<port>[0-9]{1,5})$")
_WILDCARDS = ("*", "0.0.0.0", "[::]")


@attrs.define(frozen=True)
class Endpoint:
    url: str
    bind: bool
    ipv6: bool = False


def parse_endpoint(text: str) -> Endpoint:
    """The endpoint ``text`` names; ValueError with the reason when it names none."""
    if text.startswith("ipc://"):
        if len(text) == len("ipc://"):
            raise ValueError("needs a path after ipc://")
        return Endpoint(text, bind=True)
    m = _TCP.match(text)
    if m is None:
        raise ValueError("must be a ZMQ endpoint such as tcp://*:5557 (bind) or tcp://indexer:5557 (connect)")
    host, port = m["host"], int(m["port"])
    if not 1 <= port <= 65535:
        raise ValueError("port must be between 1 and 65535")
    if host.startswith("["):
        try:
            ipaddress.IPv6Address(host[1:-1])
        except ValueError:
            raise ValueError(f"{host} is not an IPv6 address") from None
    return Endpoint(text, bind=host in _WILDCARDS, ipv6=host.startswith("["))


def check_endpoint(text: str) -> str | None:
    """An Option check: None when ``text`` is off ("") or a valid endpoint, else the problem."""
    if not text:
        return None
    try:
        parse_endpoint(text)
    except ValueError as exc:
        return str(exc)
    return None


def check_topic(template: str) -> str | None:
    try:
        template.format(host="h", port=1, model="m")
    except (KeyError, IndexError, ValueError) as exc:
        return f"may name only {{host}}, {{port}} and {{model}} ({exc})"
    return None


def advertised_host(host: str | None) -> str:
    """The address the topic names for this node: --host, or for a wildcard --host this machine's
    address (in a Kubernetes pod, its IP: the hostname resolves to it)."""
    if host and host not in ("0.0.0.0", "::", "*", ""):
        return host
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def topic_for(template: str, host: str | None, port: int | None, model: str) -> str:
    return template.format(host=advertised_host(host), port=port, model=model)
