"""Shared reading for families whose calls sit between special markers (not a family: the
registry skips ``_`` modules).

Two shapes cover DeepSeek, Kimi-K2, GLM, MiniMax and Seed-OSS:

* :class:`MarkedJson`: a call is a head naming the function, then a JSON object of arguments,
  then a closing marker (DeepSeek R1 and V3.1, Kimi-K2). The arguments are the model's own text,
  so a partial read's arguments are a prefix of the whole read's.
* :class:`TaggedParams`: a call is a head naming the function, then one tagged key and value per
  argument (GLM's ``<arg_key>``, MiniMax's and DeepSeek V3.2's ``<parameter name=...>``, Seed's
  ``<parameter=...>``). The arguments are built as JSON with :func:`arguments_json`; an argument
  is only counted once its closing tag is read, since its type is only known then.

Both read calls inside optional section markers (``<｜tool▁calls▁begin｜>...``); the calls end the
reply, as with Hermes: text after them is not content."""

from __future__ import annotations

import json
from typing import ClassVar

from superfluid.core.formats.family import ToolFormat, safe_content
from superfluid.core.formats.jsonscan import read_object, skip_ws
from superfluid.core.formats.reply import ParsedCall, arguments_json, partial_arguments_json
from superfluid.core.request import JsonChoice, text_value

#: read_call's answer while a call is still being written and its name is not known yet
_NOT_YET = (None, -1, False)


class SectionCalls(ToolFormat):
    """Calls, each opened by :attr:`call_open`, inside a section (:attr:`section_open` ...
    :attr:`section_close`; "" for families without one). A reply's calls start at the first
    section opening (or, without a section, the first call opening); what comes before is content."""

    section_open: ClassVar[str] = ""
    section_close: ClassVar[str] = ""
    call_open: ClassVar[str]

    def read_call(self, text: str, pos: int, partial: bool):
        """The call whose body starts at ``pos`` (after :attr:`call_open`): (call, index after it,
        finished); call None while its name is not written yet; None: the syntax is broken."""
        raise NotImplementedError

    def parse(self, text: str, partial: bool):
        opener = self.section_open or self.call_open
        start = text.find(opener)
        if start < 0:
            return safe_content(text, partial, opener), []
        content, calls, pos = text[:start], [], start
        while True:
            pos = skip_ws(text, pos)
            for marker in (self.section_open, self.section_close):
                if marker and text.startswith(marker, pos):
                    pos += len(marker)
                    break
            else:
                if not text.startswith(self.call_open, pos):
                    break  # the calls are over (or, partial, what follows is not written yet)
                got = self.read_call(text, pos + len(self.call_open), partial)
                if got is None:
                    return content, None
                call, pos, finished = got
                if call is not None:
                    calls.append(call)
                if not finished:
                    return safe_content(content, True), calls
        if not calls and not partial:  # a section opened, but no call in it
            return content, None
        return safe_content(content, partial), calls


class MarkedJson(SectionCalls):
    """Calls as ``call_open HEAD args_open {json} [fence] call_close``: :meth:`read_head` finds the
    name (and id) in the head. ``fence``: R1's closing code fence, which may follow the object."""

    args_open: ClassVar[str]
    call_close: ClassVar[str]
    fence: ClassVar[str] = ""

    def read_head(self, head: str) -> tuple[str, str | None] | None:
        """(name, id) of a call from its head's text (None: not a call head)."""
        name = head.strip()
        return (name, None) if name else None

    def args_start(self, text: str, pos: int, partial: bool) -> int | None:
        """Where the arguments object starts, after :attr:`args_open` at ``pos`` (None: not
        known yet, partial)."""
        return pos

    def read_call(self, text: str, pos: int, partial: bool):
        sep = text.find(self.args_open, pos)
        if sep < 0:
            return _NOT_YET if partial else None
        head = self.read_head(text[pos:sep])
        if head is None:
            return None
        name, call_id = head
        start = self.args_start(text, sep + len(self.args_open), partial)
        if start is None:
            return ParsedCall(name, "", call_id), len(text), False
        args, end, complete = read_object(text, start)
        if args is None:
            return None
        if not complete:
            return (ParsedCall(name, args, call_id), end, False) if partial else None
        call = ParsedCall(name, args, call_id)
        end = skip_ws(text, end)
        if self.fence and text.startswith(self.fence, end):
            end = skip_ws(text, end + len(self.fence))
        rest = text[end:]
        if rest.startswith(self.call_close):
            return call, end + len(self.call_close), True
        if not rest:  # the reply ends after the object: a whole read takes the call as written
            return call, end, not partial
        if partial and any(m.startswith(rest) for m in (self.call_close, self.fence) if m):
            return call, len(text), False
        return None


def _no_constant(name: str):
    raise ValueError(name)  # NaN and Infinity are not JSON, so they stay text


def text_or_json(raw: str):
    """A tagged value written raw for a string and as JSON otherwise (the GLM and MiniMax
    templates' ``v | tojson if v is not string else v``): JSON when it reads as a non-string value,
    else the text. Without the tool's schema a string that looks like a number reads as one."""
    try:
        value = json.loads(raw, parse_constant=_no_constant)
    except ValueError:
        return raw
    return raw if isinstance(value, str) else value


class TaggedParams(SectionCalls):
    """Calls as ``call_open NAME head_end`` then, per argument, ``param_open KEY... param_head_end
    VALUE value_close``, then ``call_close``."""

    reads_raw_values = True

    head_end: ClassVar[str]
    param_open: ClassVar[str]
    param_head_end: ClassVar[str]
    value_close: ClassVar[str]
    call_close: ClassVar[str]
    #: how a forced call's text begins (before the name) and ends (after the last argument)
    call_tail: ClassVar[str]

    def read_name(self, text: str, pos: int) -> tuple[str, int] | None:
        """(name, index after the head) of the call whose head starts at ``pos``; None: the head
        is not complete."""
        end = text.find(self.head_end, pos)
        return None if end < 0 else (text[pos:end].strip(), end + len(self.head_end))

    def param_key(self, head: str) -> tuple[str, bool | None] | None:
        """(key, whether the value is a string: None when the syntax does not say) from the text
        between :attr:`param_open` and :attr:`param_head_end`; None: not a parameter."""
        key = head.strip()
        return (key, None) if key else None

    def value(self, raw: str, is_string: bool | None):
        if is_string:
            return raw
        if is_string is False:
            return json.loads(raw, parse_constant=_no_constant)
        return text_or_json(raw)

    def read_call(self, text: str, pos: int, partial: bool):
        head = self.read_name(text, pos)
        if head is None:
            return _NOT_YET if partial else None
        name, pos = head
        if not name:
            return None
        args: dict = {}
        while True:
            pos = skip_ws(text, pos)
            if text.startswith(self.call_close, pos):
                return ParsedCall(name, arguments_json(args)), pos + len(self.call_close), True
            if text.startswith(self.param_open, pos):
                key_at = pos + len(self.param_open)
                head_end = text.find(self.param_head_end, key_at)
                value_at = head_end + len(self.param_head_end)
                close = text.find(self.value_close, value_at) if head_end >= 0 else -1
                if close >= 0:
                    key = self.param_key(text[key_at:head_end])
                    if key is None or key[0] in args:
                        return None
                    try:
                        is_string = True if key[1] is None and self.is_string(name, key[0]) else key[1]
                        args[key[0]] = self.value(text[value_at:close], is_string)
                    except ValueError:
                        return None
                    pos = close + len(self.value_close)
                    continue
            elif pos < len(text) and not (partial and any(
                    m.startswith(text[pos:]) for m in (self.param_open, self.call_close))):
                return None
            if not partial:  # the reply ends between arguments: the call, less its closing
                # (a forced call stops at its call_stop); anything else is cut off inside the call
                return (ParsedCall(name, arguments_json(args)), pos, True) if pos >= len(text) else None
            return ParsedCall(name, partial_arguments_json(args)), len(text), False

    # ---- writing one call ----------------------------------------------------------------------

    def call_lead_text(self, name: str) -> str:
        raise NotImplementedError

    def param_lead(self, key: str, is_string: bool) -> str:
        raise NotImplementedError

    def call_choice(self, function: dict) -> JsonChoice:
        """The call's head, then one piece per parameter in the schema's order (left out when not
        required): its opening tag, the value (plain text for a string, else JSON held to the
        property's schema), then its closing tag."""
        params = function.get("parameters") or {}
        required = set(params.get("required") or ())
        pieces = []
        for key, schema in (params.get("properties") or {}).items():
            is_string = isinstance(schema, dict) and schema.get("type") == "string"
            pieces.append(JsonChoice(self.param_lead(key, is_string), text_value(schema) if is_string else schema,
                                     (JsonChoice(self.value_close, None),), optional=key not in required))
        return JsonChoice(self.call_lead_text(function["name"]), None, tuple(pieces))
