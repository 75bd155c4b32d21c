"""Google Gemma 4: calls as ``<|tool_call>call:NAME{key:value,...}<tool_call|>``, one block per
call, reasoning as ``<|channel>thought ... <channel|>``.

A value is written as the template's ``format_argument`` writes it: a string between ``<|"|>``
quotes (no escaping), ``true``/``false``, a number, a mapping ``{key:value}`` with bare keys, a
list ``[...]``. JSON strings and quoted keys are read too (a forced call writes its values as
JSON). The arguments are built as JSON (:func:`arguments_json`); while a call streams, its
arguments are those whose values are complete, a prefix of the whole read's.

The template ends a turn of calls with ``<|tool_response>`` (the tool's answer follows it); like
any text after the calls, it is not content. Its generation prompt closes an empty thought channel
unless ``enable_thinking`` is set, and a rendered assistant turn never holds that empty channel:
only with ``enable_thinking`` is a rendered reply the prompt's continuation."""

from __future__ import annotations

import json
import re

from superfluid.core.formats.family import ReasoningFormat, ToolFormat, safe_content
from superfluid.core.formats.jsonscan import skip_ws, value_end
from superfluid.core.formats.reply import ParsedCall, arguments_json, partial_arguments_json
from superfluid.core.request import JsonChoice

from ._keyword_args import keyword_choice

OPEN, CLOSE, CALL, QUOTE = "<|tool_call>", "<tool_call|>", "call:", '<|"|>'
_NAME = re.compile(r"[^{}\s<]+")
_BARE_KEY = re.compile(r"[^:{}\[\],\s<]+")
_SCALAR = re.compile(r"[^,}\]\s<]+")
_WORDS = {"true": True, "false": False, "null": None, "True": True, "False": False, "None": None}


class _Cut(Exception):
    """The text ends inside a call: a partial read stops there, a whole read finds it broken."""


def _text(text: str, pos: int) -> tuple[str, int] | None:
    """A quoted string at ``pos`` (``<|"|>...<|"|>`` or JSON): (its text, index after), None if
    there is none there. Raises :class:`_Cut` if it is cut off."""
    if text.startswith(QUOTE, pos):
        end = text.find(QUOTE, pos + len(QUOTE))
        if end < 0:
            raise _Cut
        return text[pos + len(QUOTE):end], end + len(QUOTE)
    if QUOTE.startswith(text[pos:]):
        raise _Cut
    if text[pos] == '"':
        end = value_end(text, pos)
        if end is None:
            raise _Cut
        return json.loads(text[pos:end]), end
    return None


def _key(text: str, pos: int) -> tuple[str, int]:
    """A mapping's key and the index after its ``:``."""
    quoted = _text(text, pos)
    if quoted is None:
        bare = _BARE_KEY.match(text, pos)
        if bare is None:
            raise ValueError("not a key")
        quoted = bare.group(), bare.end()
    key, pos = quoted
    pos = skip_ws(text, pos)
    if pos >= len(text):
        raise _Cut
    if text[pos] != ":":
        raise ValueError("no ':' after a key")
    return key, pos + 1


def read_value(text: str, pos: int):
    """The value at ``pos``: (value, index after). Raises :class:`_Cut` or ValueError."""
    pos = skip_ws(text, pos)
    if pos >= len(text):
        raise _Cut
    quoted = _text(text, pos)
    if quoted is not None:
        return quoted
    if text[pos] in "{[":
        closing, out = ("}", {}) if text[pos] == "{" else ("]", [])
        pos += 1
        while True:
            pos = skip_ws(text, pos)
            if pos >= len(text):
                raise _Cut
            if text[pos] == closing:
                return out, pos + 1
            if out and text[pos] == ",":
                pos += 1
                continue
            if closing == "}":
                key, pos = _key(text, pos)
                out[key], pos = read_value(text, pos)
            else:
                value, pos = read_value(text, pos)
                out.append(value)
    scalar = _SCALAR.match(text, pos)
    if scalar is None:
        raise ValueError("not a value")
    if scalar.end() >= len(text):
        raise _Cut
    word = scalar.group()
    if word in _WORDS:
        return _WORDS[word], scalar.end()
    value = json.loads(word)
    if not isinstance(value, (int, float)):
        raise ValueError("not a value")
    return value, scalar.end()


def read_call(text: str, pos: int) -> tuple[ParsedCall, int]:
    """The ``call:NAME{...}`` body at ``pos`` (after the opening marker): (call, index after its
    ``}``). Raises :class:`_Cut` with the call so far (``args[0]``: None while its name is cut
    off), ValueError if it is broken."""
    if not text.startswith(CALL, pos):
        if CALL.startswith(text[pos:]):
            raise _Cut(None)
        raise ValueError("no call:")
    name = _NAME.match(text, pos + len(CALL))
    if name is None or name.end() >= len(text):
        if name is None and pos + len(CALL) < len(text):
            raise ValueError("no name")
        raise _Cut(None)
    if text[name.end()] != "{":
        raise ValueError("no arguments")
    args: dict = {}
    i = name.end() + 1
    try:
        while True:
            i = skip_ws(text, i)
            if i >= len(text):
                raise _Cut
            if text[i] == "}":
                return ParsedCall(name.group(), arguments_json(args)), i + 1
            if text[i] == ",":  # between pairs, or before the first of a forced call that left one out
                i += 1
                continue
            key, i = _key(text, i)
            if key in args:
                raise ValueError("a key twice")
            args[key], i = read_value(text, i)
    except _Cut:
        raise _Cut(ParsedCall(name.group(), partial_arguments_json(args))) from None


class Gemma4(ToolFormat):
    name = "gemma4"
    description = '<|tool_call>call:NAME{key:<|"|>value<|"|>}<tool_call|> (Gemma 4)'
    reasoning = "gemma4"
    call_tail = "}" + CLOSE
    call_stop = CLOSE

    def detect(self, template: str) -> int:
        return 30 if OPEN + CALL in template else 0

    def call_choice(self, function: dict) -> JsonChoice:
        return keyword_choice(f"{OPEN}{CALL}{function['name']}{{", function,
                              lambda key, first: f"{'' if first else ','}{key}:")

    def parse(self, text: str, partial: bool):
        start = text.find(OPEN)
        if start < 0:
            return safe_content(text, partial, OPEN), []
        content, calls, pos = text[:start], [], start
        try:
            while text.startswith(OPEN, pos):
                call, pos = read_call(text, pos + len(OPEN))
                calls.append(call)
                pos = skip_ws(text, pos)
                if text.startswith(CLOSE, pos):
                    pos = skip_ws(text, pos + len(CLOSE))
        except _Cut as cut:
            if not partial:
                return content, None
            if cut.args and cut.args[0] is not None:
                calls.append(cut.args[0])
            return safe_content(content, True), calls
        except (ValueError, TypeError):
            return content, None
        return safe_content(content, partial), calls


GEMMA4_THOUGHT = ReasoningFormat("gemma4", "<|channel>thought", "<channel|>",
                                 "<|channel>thought ... <channel|> (Gemma 4)")

FORMATS = (Gemma4(), GEMMA4_THOUGHT)
