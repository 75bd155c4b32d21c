"""The built-in chat formats: one module per model family's tool-call syntax, and the reasoning
spans families use, registered like a third party's (``superfluid_add_chat_formats``).

See :mod:`superfluid.core.formats` for what a format is; docs/formats.md lists every family, the
templates it was checked on, and how to choose one."""

from __future__ import annotations

from superfluid.core.hookspecs import hookimpl

from . import hermes
from .reasoning import REASONING_FORMATS

TOOL_FORMATS = (hermes.Hermes(),)


@hookimpl
def superfluid_add_chat_formats(register):
    for fmt in (*TOOL_FORMATS, *REASONING_FORMATS):
        register(fmt)
