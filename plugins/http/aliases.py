"""Model aliases: another name for a served model, optionally at a QoS class of its own.

Why: an agent CLI sends two kinds of request under two model names. Claude Code's main turns go
to its main model; its title, summary and classification calls go to its small/fast model slot
(``ANTHROPIC_SMALL_FAST_MODEL``). Pointing that slot at an alias such as
``claude-haiku=smollm2@background`` runs the side requests on the same weights, so they share
the prompt cache, at the ``background`` class, so they never hold up the person's turn.

Configured with ``model-alias = ["NAME=MODEL[@CLASS]", ...]`` in TOML or ``--model-alias``
(repeatable). A request naming an alias is served by its model; the alias's class is the class
the request asks for when it names none itself (a header or the body's extension still wins),
and a key's ceiling applies to it as to any asked class."""

from __future__ import annotations

import re

import attrs
from aiohttp import web

from superfluid.core import qos
from superfluid.core.errors import ConfigError

_ALIAS = re.compile(r"^\s*([^=@\s][^=@]*?)\s*=\s*([^=@\s][^=@]*?)\s*(?:@\s*([A-Za-z_-]+)\s*)?$")


@attrs.define(frozen=True)
class Alias:
    name: str
    model: str
    qos: str | None = None  # the class its requests ask for (None: the default's rules)


def parse_alias(text: str) -> Alias:
    """``NAME=MODEL`` or ``NAME=MODEL@CLASS`` (a class name or one of its aliases)."""
    found = _ALIAS.match(text)
    if found is None:
        raise ConfigError(f"expected NAME=MODEL or NAME=MODEL@CLASS, got {text!r}")
    name, model, cls = found.groups()
    return Alias(name=name, model=model, qos=qos.resolve(cls, param="model-alias") if cls else None)


class Aliases:
    """The configured aliases, checked against the served models' names when the front end starts."""

    def __init__(self, aliases: list[Alias], served: list[str]):
        self.by_name: dict[str, Alias] = {}
        for alias in aliases:
            if alias.name in self.by_name:
                raise ConfigError(f"model-alias: {alias.name!r} is given twice")
            if alias.name in served:
                raise ConfigError(f"model-alias: {alias.name!r} is already a served model's name")
            if alias.model not in served:
                raise ConfigError(f"model-alias: {alias.name!r} names {alias.model!r}, which is not served "
                                  f"(served: {', '.join(served) or 'none'})")
            self.by_name[alias.name] = alias

    def model(self, name: str | None) -> str | None:
        """The served model's name for a request's ``model`` (itself unless an alias)."""
        alias = self.by_name.get(name) if name else None
        return alias.model if alias is not None else name

    def qos(self, name: str | None) -> str | None:
        """The class an alias asks for, or None."""
        alias = self.by_name.get(name) if name else None
        return alias.qos if alias is not None else None

    def __iter__(self):
        return iter(self.by_name.values())


ALIASES = web.AppKey("model_aliases", Aliases)


def served_name(request: web.Request, name: str | None) -> str | None:
    """The served model a request naming ``name`` gets (``name`` itself unless an alias)."""
    aliases = request.app.get(ALIASES)
    return aliases.model(name) if aliases is not None else name
