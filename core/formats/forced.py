"""A forced call (``tool_choice`` "required" or a named function) in the family's own syntax.

The reply is pre-filled with what every allowed call begins with, and, on an engine that can
constrain sampling, the rest is held by a grammar to one of the allowed calls, its arguments to
the function's ``parameters`` schema, then the call's closing, then the end. An engine without
constraints gets the pre-fill alone, and its reply is read like any other."""

from __future__ import annotations

import os

import attrs

from ..request import JsonConstraint, is_text
from .family import ToolFormat


@attrs.frozen
class ForcedCall:
    prefill: str
    constraint: JsonConstraint | None = None
    stop: tuple[str, ...] = ()


def forced_call(fmt: ToolFormat, functions: list[dict], grammars: bool) -> ForcedCall:
    """The pre-fill and constraint that make the reply one call of one of ``functions`` (OpenAI
    ``function`` objects: the named one alone, or every offered one for "required")."""
    choices = [fmt.call_choice(fn) for fn in functions]
    prefill = os.path.commonprefix([c.lead for c in choices])
    if len(choices) > 1:  # stop the pre-fill before a name's first character, never inside it
        prefill = prefill[:_name_start(prefill, [fn["name"] for fn in functions])]
        prefill = prefill.rstrip(' "')  # a quote opening the name goes with it: the grammar writes both
    stop = (fmt.call_stop,) if fmt.call_stop else ()
    if not grammars:  # no grammar to hold the arguments: open their object for the model
        one = choices[0]
        if len(choices) == 1 and one.schema is not None and not is_text(one.schema) and not one.rest:
            return ForcedCall(one.lead + "{", None, stop)
        return ForcedCall(prefill, None, stop)
    prefill = prefill.rstrip(" ")  # a space belongs to the next token: the grammar writes it
    rest = tuple(attrs.evolve(c, lead=c.lead[len(prefill):]) for c in choices)
    return ForcedCall(prefill, JsonConstraint(choices=rest, tail=fmt.call_tail))


def _name_start(prefill: str, names: list[str]) -> int:
    """Where the pre-fill must end so that no name is begun in it: before the longest end of the
    pre-fill that every name begins with."""
    for k in range(len(prefill)):
        if all(name.startswith(prefill[k:]) for name in names):
            return k
    return len(prefill)
