"""Liquid LFM2 and LFM2.5: pythonic calls, ``<|tool_call_start|>[name(key='value', n=1),
other(...)]<|tool_call_end|>``. LFM2.5 reasons in ``<think>...</think>`` (the ``think`` format).

Values are Python literals (the LFM2.5 template writes strings in single quotes, mappings as JSON,
the rest with Jinja's ``string``, so booleans as ``True``); JSON's ``true``, ``false`` and ``null``
are read too. The arguments are built as JSON (:func:`arguments_json`); while a call streams, its
arguments are those whose values are complete, a prefix of the whole read's.

The LFM2 (8B-A1B) template renders an assistant turn as its content alone, dropping its calls (its
tool list is marked ``<|tool_list_start|>``), so its round trip has no call to read back; the
model writes calls as LFM2.5 does."""

from __future__ import annotations

import ast
import json
import re

from superfluid.core.formats.family import ToolFormat, safe_content
from superfluid.core.formats.jsonscan import skip_ws
from superfluid.core.formats.reply import ParsedCall, arguments_json, partial_arguments_json
from superfluid.core.request import JsonChoice

from ._keyword_args import keyword_choice

OPEN, CLOSE, TOOL_LIST = "<|tool_call_start|>", "<|tool_call_end|>", "<|tool_list_start|>"
_NAME = re.compile(r"[A-Za-z_][\w.-]*")
_KEY = re.compile(r"[A-Za-z_]\w*")


class _Cut(Exception):
    """The text ends inside a call: a partial read stops there, a whole read finds it broken."""


def value_end(text: str, pos: int) -> int:
    """The index after the Python literal at ``pos``: where a ``,`` or ``)`` outside brackets and
    quotes ends it. Raises :class:`_Cut` if the text ends first, ValueError on a stray bracket."""
    depth, quote, i = 0, None, pos
    while i < len(text):
        c = text[i]
        if quote:
            if c == "\\":
                i += 1
            elif c == quote:
                quote = None
        elif c in "'\"":
            quote = c
        elif c in "([{":
            depth += 1
        elif c in ")]}":
            if depth == 0:
                if c != ")":
                    raise ValueError(c)
                return i
            depth -= 1
        elif c == "," and depth == 0:
            return i
        i += 1
    raise _Cut


def literal(source: str):
    """A value's text as Python reads it, or as JSON (``true``); ValueError if neither."""
    try:
        return ast.literal_eval(source.strip())
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return json.loads(source)


def read_call(text: str, pos: int, partial: bool) -> tuple[ParsedCall | None, int]:
    """The ``name(key=value, ...)`` call at ``pos``: (call, index after it). Raises :class:`_Cut`
    with the call so far (``args[0]``: None while its name is cut off), ValueError if broken."""
    name = _NAME.match(text, pos)
    if name is None or name.end() >= len(text):
        if pos >= len(text) or name is not None:
            raise _Cut(None)
        raise ValueError("not a call")
    if text[name.end()] != "(":
        raise ValueError("no arguments")
    args: dict = {}
    i = name.end() + 1

    def cut():
        return _Cut(ParsedCall(name.group(), partial_arguments_json(args)))

    while True:
        i = skip_ws(text, i)
        if i >= len(text):
            raise cut()
        if text[i] == ")":
            return ParsedCall(name.group(), arguments_json(args)), i + 1
        if text[i] == "," and not args:  # a forced call that left out its first (optional) argument
            i = skip_ws(text, i + 1)
        key = _KEY.match(text, i)
        if key is None:
            if i >= len(text):
                raise cut()
            raise ValueError("not an argument")
        eq = skip_ws(text, key.end())
        if eq >= len(text):
            raise cut()
        if text[eq] != "=" or key.group() in args:
            raise ValueError("not an argument")
        try:
            end = value_end(text, eq + 1)
        except _Cut:
            raise cut() from None
        args[key.group()] = literal(text[eq + 1:end])
        i = end + 1 if text[end] == "," else end


class Lfm2(ToolFormat):
    name = "lfm2"
    description = "<|tool_call_start|>[name(key='value')]<|tool_call_end|> (LFM2, LFM2.5)"
    call_tail = ")]" + CLOSE
    call_stop = CLOSE

    def detect(self, template: str) -> int:
        return 30 if OPEN in template or TOOL_LIST in template else 0

    def call_choice(self, function: dict) -> JsonChoice:
        return keyword_choice(f"{OPEN}[{function['name']}(", function,
                              lambda key, first: f"{'' if first else ', '}{key}=")

    def parse(self, text: str, partial: bool):
        start = text.find(OPEN)
        if start < 0:
            return safe_content(text, partial, OPEN), []
        content, calls = text[:start], []
        pos = skip_ws(text, start + len(OPEN))
        listed = text.startswith("[", pos)
        pos = pos + 1 if listed else pos
        try:
            while True:
                call, pos = read_call(text, skip_ws(text, pos), partial)
                calls.append(call)
                pos = skip_ws(text, pos)
                if not (listed and text.startswith(",", pos)):
                    break
                pos += 1
        except _Cut as cut:
            if not partial:
                return content, None
            if cut.args and cut.args[0] is not None:
                calls.append(cut.args[0])
            return safe_content(content, True), calls
        except (ValueError, TypeError):  # TypeError: a literal JSON cannot hold (a set, bytes)
            return content, None
        if listed and pos >= len(text) and partial:
            return safe_content(content, True), calls  # more calls may follow
        if listed and not text.startswith("]", pos) and pos < len(text):
            return content, None
        return safe_content(content, partial), calls


FORMATS = (Lfm2(),)
