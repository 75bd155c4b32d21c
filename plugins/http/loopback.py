"""Whether a listen address reaches only this machine.

Two start-up checks ask it: the key policy's (``keys/auth.py``: a non-loopback ``--host`` with no
key policy is an open door) and CORS's (``cors.py``: ``--cors-origins '*'`` needs a key policy or
a loopback ``--host``). It lives apart from both so neither imports the other, and so the
options that validate ``--cors-origins`` need not import the key policy."""

from __future__ import annotations

import ipaddress


def is_loopback_host(host: str | None) -> bool:
    """Whether a listen address reaches only this machine ("localhost", 127.x, ::1)."""
    host = (host or "").strip().strip("[]")
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name (or "" for every address) may well be reachable from outside
