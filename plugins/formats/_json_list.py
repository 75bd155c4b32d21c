"""Shared reading for families that write their calls as one JSON list of call objects after a
marker (not a family: the registry skips ``_`` modules).

Granite 3.3 (``<|tool_call|>[...]``), Nemotron Nano v2 (``<TOOLCALL>[...]</TOOLCALL>``) and
Command R7B (``<|START_ACTION|>[...]<|END_ACTION|>``) differ only in the marker and in the keys of
a call object, so :class:`JsonListCalls` reads them all. Arguments are the model's own text of the
object (never re-serialised), so a partial read's arguments are a prefix of the whole read's.

As with Hermes, the calls end the reply: text after the list (the closing marker, a stop string
the engine cut, what a template writes after the turn) is not content."""

from __future__ import annotations

import json
from typing import ClassVar

from superfluid.core.formats.family import ToolFormat, safe_content
from superfluid.core.formats.jsonscan import read_call_object, skip_ws
from superfluid.core.formats.reply import ParsedCall

#: read_list's verdicts: the list is closed; it is still being written; it is not a list of calls
DONE, OPEN, BROKEN = "done", "open", "broken"


def read_list(text: str, pos: int, partial: bool, *, name_keys=("name",),
              argument_keys=("arguments", "parameters"), id_keys=("id",)) -> tuple[str, list[ParsedCall], int]:
    """The calls of the JSON list that starts at ``pos`` (after whitespace): (verdict, calls,
    index after the list). A single call object without the list's brackets is read as a list of
    one (small models drop them). A whole read whose text ends right after a complete call takes
    the list as closed there: an engine's stop string may have cut its ``]``."""
    pos = skip_ws(text, pos)
    if pos >= len(text):
        return OPEN, [], pos
    listed = text[pos] == "["
    if listed:
        pos += 1
    elif text[pos] != "{":
        return BROKEN, [], pos
    calls: list[ParsedCall] = []
    while True:
        call = read_call_object(text, pos, name_keys=name_keys, argument_keys=argument_keys, id_keys=id_keys)
        if call is None or (call.name is None and (call.complete or not partial)):
            return BROKEN, calls, pos
        if call.name is None:  # not far enough to name the call yet
            return OPEN, calls, pos
        if not call.complete:
            if not partial:
                return BROKEN, calls, pos
            calls.append(ParsedCall(call.name, call.arguments or "", call.id))
            return OPEN, calls, len(text)
        calls.append(ParsedCall(call.name, call.arguments or "{}", call.id))
        pos = skip_ws(text, call.end)
        if not listed:
            return DONE, calls, pos
        if pos >= len(text):
            return (OPEN if partial else DONE), calls, pos
        if text[pos] == "]":
            return DONE, calls, pos + 1
        if text[pos] != ",":
            return BROKEN, calls, pos
        pos += 1


class JsonListCalls(ToolFormat):
    """Calls as ``open [ {call}, ... ] close``; what comes before :attr:`open` is content. Several
    lists in a row (each with its markers) are read as one."""

    open: ClassVar[str]
    close: ClassVar[str] = ""
    name_keys: ClassVar[tuple[str, ...]] = ("name",)
    argument_keys: ClassVar[tuple[str, ...]] = ("arguments", "parameters")
    id_keys: ClassVar[tuple[str, ...]] = ("id",)
    #: how a forced call's object begins, before its name (``{"name": `` for most)
    object_lead: ClassVar[str] = '{"name": '
    #: what comes between the name and the arguments object
    name_tail: ClassVar[str] = ', "arguments": '
    #: what closes the list after the last call object (before :attr:`close`)
    list_end: ClassVar[str] = "]"

    def call_lead(self, name: str) -> str:
        return f"{self.open}[{self.object_lead}{json.dumps(name, ensure_ascii=False)}{self.name_tail}"

    @property
    def call_tail(self) -> str:  # type: ignore[override]
        return "}" + self.list_end + self.close

    @property
    def call_stop(self) -> str:  # type: ignore[override]
        return self.close

    def parse(self, text: str, partial: bool):
        start = text.find(self.open)
        if start < 0:
            return safe_content(text, partial, self.open), []
        return self.read_calls(text, start, partial)

    def read_calls(self, text: str, start: int, partial: bool):
        """(content, calls) of a reply whose first list marker is at ``start``."""
        content, calls, pos = text[:start], [], start
        while text.startswith(self.open, pos):
            verdict, more, pos = read_list(text, pos + len(self.open), partial, name_keys=self.name_keys,
                                           argument_keys=self.argument_keys, id_keys=self.id_keys)
            calls.extend(more)
            if verdict == BROKEN or (verdict == OPEN and not partial):
                return content, None
            if verdict == OPEN:
                return safe_content(content, True), calls
            pos = skip_ws(text, pos)
            if self.close and text.startswith(self.close, pos):
                pos = skip_ws(text, pos + len(self.close))
        return safe_content(content, partial), calls
