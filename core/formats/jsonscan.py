"""Reading JSON that a model is still writing: a call object (``{"name": ..., "arguments": ...}``)
or a bare value, whole or cut off anywhere.

Formats that write calls as JSON share these. Arguments are returned as the model's own text of
the value (never re-serialised), so the text read from a prefix of a reply is a prefix of the text
read from the whole."""

from __future__ import annotations

import json
import re

import attrs

_DECODER = json.JSONDecoder()
_WS = re.compile(r"\s*")


@attrs.frozen
class JsonCall:
    """A call object read from text. ``name`` None: not known yet (partial) or absent;
    ``arguments``: the value's own text (a prefix of it while ``complete`` is False); ``end``: the
    index after the object (where the read stopped, when incomplete)."""

    name: str | None
    arguments: str | None
    id: str | None
    end: int
    complete: bool


def skip_ws(text: str, pos: int) -> int:
    return _WS.match(text, pos).end()


def value_end(text: str, pos: int) -> int | None:
    """The index after the JSON value starting at ``pos`` (None: it does not parse, or is cut off)."""
    try:
        return _DECODER.raw_decode(text, pos)[1]
    except ValueError:
        return None


def _arguments_text(raw: str) -> str | None:
    """A complete arguments value as the call's JSON text: an object as written; a string that
    holds a JSON object (some models write ``"arguments": "{...}"``) as that object's text."""
    value = json.loads(raw)
    if isinstance(value, dict):
        return raw
    if isinstance(value, str):
        try:
            inner = json.loads(value)
        except ValueError:
            return None
        return value if isinstance(inner, dict) else None
    return None


def read_call_object(text: str, pos: int, *, name_keys=("name",), argument_keys=("arguments", "parameters"),
                     id_keys=("id",)) -> JsonCall | None:
    """The call object that starts at ``pos`` (after whitespace): None if what is there is not
    the start of one (a complete object without a name, or text that is not JSON). A cut-off
    object gives what was read so far, ``complete`` False."""
    pos = skip_ws(text, pos)
    if pos >= len(text):
        return JsonCall(None, None, None, pos, False)
    if text[pos] != "{":
        return None
    name = args = call_id = None
    i = pos + 1
    while True:
        i = skip_ws(text, i)
        if i >= len(text):
            return JsonCall(name, args, call_id, i, False)
        if text[i] == "}":
            if name is None:
                return None
            return JsonCall(name, args if args is not None else "{}", call_id, i + 1, True)
        if text[i] == ",":
            i += 1
            continue
        key_end = value_end(text, i)
        if key_end is None:
            return JsonCall(name, args, call_id, i, False) if text[i] == '"' else None
        key = json.loads(text[i:key_end])
        if not isinstance(key, str):
            return None
        i = skip_ws(text, key_end)
        if i >= len(text):
            return JsonCall(name, args, call_id, i, False)
        if text[i] != ":":
            return None
        i = skip_ws(text, i + 1)
        if i >= len(text):
            return JsonCall(name, args, call_id, i, False)
        end = value_end(text, i)
        if end is None:  # the value is cut off (or broken: the whole read decides)
            if key in argument_keys and text[i] == "{":
                return JsonCall(name, text[i:], call_id, len(text), False)
            return JsonCall(name, args, call_id, i, False)
        raw = text[i:end]
        if key in name_keys:
            value = json.loads(raw)
            if not isinstance(value, str):
                return None
            name = value
        elif key in argument_keys:
            args = _arguments_text(raw)
            if args is None:
                return None
        elif key in id_keys:
            value = json.loads(raw)
            call_id = value if isinstance(value, str) else str(value)
        i = end


def read_object(text: str, pos: int) -> tuple[str | None, int, bool]:
    """A bare JSON object (a call's arguments) at ``pos`` after whitespace: (its text, the index
    after it, complete). Cut off: the text so far, ``complete`` False. Not an object: (None, pos, True)."""
    pos = skip_ws(text, pos)
    if pos >= len(text):
        return "", pos, False
    if text[pos] != "{":
        return None, pos, True
    end = value_end(text, pos)
    if end is None:
        return text[pos:], len(text), False
    return text[pos:end], end, True
