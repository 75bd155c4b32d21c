"""The built-in chat formats: one module per model family's tool-call syntax (and the reasoning
spans families use), registered like a third party's through ``superfluid_add_chat_formats``.

Each family module lists what it adds in ``FORMATS``; this package registers every module's, in
name order. See :mod:`superfluid.core.formats` for what a format is; docs/formats.md lists every
family, the templates it was checked on, and how to choose one."""

from __future__ import annotations

import importlib
import pkgutil

from superfluid.core.hookspecs import hookimpl

#: modules of this package that are not families
_NOT_FAMILIES = {"roundtrip", "cli", "setup"}


def builtin_formats() -> list:
    """Every format the built-in family modules define, in module-name order."""
    out = []
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if info.name in _NOT_FAMILIES or info.name.startswith("_"):
            continue
        out.extend(getattr(importlib.import_module(f"{__name__}.{info.name}"), "FORMATS", ()))
    return out


def builtin_registry():
    """A registry of the built-in formats alone (tools and tests that need no plugin manager)."""
    from superfluid.core.formats.registry import FormatRegistry

    registry = FormatRegistry()
    for fmt in builtin_formats():
        registry.add(fmt)
    return registry


@hookimpl
def superfluid_add_chat_formats(register):
    for fmt in builtin_formats():
        register(fmt)


@hookimpl
def superfluid_add_commands(register):
    """``superfluid template …`` (:mod:`.cli`), imported only when a command line is parsed."""
    from . import cli

    register("template", cli.HELP, cli.add_arguments, cli.run)
