"""Forced calls for families whose arguments are keyword pairs, not a JSON object (not a family:
the registry skips ``_`` modules): LFM2's ``name(key=value, ...)`` and Gemma 4's
``call:name{key:value,...}``.

Each parameter is one piece of the call's :class:`~superfluid.core.request.JsonChoice`: its key
and separator as the piece's lead, its value as JSON held to the property's schema (the readers of
both families take JSON values: a JSON string or number is also a Python literal and a Gemma
value). Required parameters come first, so that the first piece, which has no separator before
it, is always written; when a function has no required parameter, every piece is optional and a
call that leaves out the first starts with the separator (``name(, b=1)``), which the readers
skip."""

from __future__ import annotations

from typing import Callable

from superfluid.core.request import JsonChoice


def keyword_choice(lead: str, function: dict, piece_lead: Callable[[str, bool], str]) -> JsonChoice:
    """The call of ``function`` (an OpenAI ``function`` object) from ``lead``: one piece per
    property, ``piece_lead(key, first)`` before its value. A function whose parameters list no
    properties takes no arguments (a free-form object cannot be written as keyword pairs)."""
    params = function.get("parameters") or {}
    properties = params.get("properties") or {}
    required = [k for k in properties if k in set(params.get("required") or ())]
    ordered = required + [k for k in properties if k not in required]
    pieces = tuple(JsonChoice(piece_lead(key, i == 0), properties[key] if isinstance(properties[key], dict) else {},
                              optional=key not in required)
                   for i, key in enumerate(ordered))
    return JsonChoice(lead, None, pieces)
