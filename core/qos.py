"""The QoS class vocabulary: names, aliases and priority order.

This is shared language between front ends (which read a class from a header or a key policy)
and policies (which order queues by it); the policies themselves live in plugins."""

from __future__ import annotations

from .errors import InvalidRequest

CLASSES = ("interactive", "completion", "agent", "background")
DEFAULT_CLASS = "agent"
URGENT = ("interactive", "completion")  # classes that may preempt and end a running tick early

ALIASES = {
    "interactive": "interactive", "interactive-chat": "interactive", "0": "interactive",
    "completion": "completion", "inline-completion": "completion", "1": "completion",
    "agent": "agent", "foreground": "agent", "foreground-agent": "agent", "2": "agent",
    "background": "background", "background-agent": "background", "3": "background",
}


def priority(name: str) -> int:
    """0 is the most urgent class."""
    return CLASSES.index(name)


def resolve(name: str, *, param: str = "x-superfluid-qos") -> str:
    """The canonical class for a name or alias; an unknown name is a 400 listing valid ones."""
    canonical = ALIASES.get(str(name).strip().lower())
    if canonical is None:
        valid = ", ".join(sorted(ALIASES, key=lambda a: (priority(ALIASES[a]), a)))
        raise InvalidRequest(f"unknown QoS class {name!r}; valid names: {valid}",
                             param=param, code="invalid_qos_class")
    return canonical
