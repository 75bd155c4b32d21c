"""Mistral's ``[TOOL_CALLS]`` calls, in the two shapes its models write, and the ``[THINK]`` span.

- ``mistral-nemo`` (Mistral Nemo, Mistral 7B v0.3): one JSON list of call objects,
  ``[TOOL_CALLS][{"name": ..., "arguments": {...}, "id": "abcDEF123"}, ...]``.
- ``mistral`` (Mistral Small 3.2, Ministral 3, Magistral, Devstral): each call on its own,
  ``[TOOL_CALLS]NAME[CALL_ID]abcDEF123[ARGS]{...}``; ``[CALL_ID]`` is left out by the newest.

Both formats read both shapes (a model fine-tuned from another checkpoint may keep the older one);
they differ in how a forced call is written and in which template is theirs. The id a model writes
is the call's id, so a tool result's ``tool_call_id`` is the one the model will look for. A JSON
call is streamed only once its object is complete, since its id comes after its arguments; a
``[CALL_ID]`` call once ``[ARGS]`` is read, its arguments as they grow."""

from __future__ import annotations

import json

from superfluid.core.formats.family import ReasoningFormat, ToolFormat, safe_content
from superfluid.core.formats.jsonscan import read_call_object, read_object, skip_ws
from superfluid.core.formats.reply import ParsedCall
from superfluid.plugins.formats.hermes import json_call

TOOL_CALLS, CALL_ID, ARGS = "[TOOL_CALLS]", "[CALL_ID]", "[ARGS]"


def read_call_list(text: str, pos: int, partial: bool, *, whole_calls: bool = False):
    """The call objects of a JSON list whose ``[`` ends before ``pos``: (calls, the index after
    ``]``), the index None while the list is still being written (partial); None when the list
    is not a list of calls. ``whole_calls``: a partial read leaves out a call whose object is not
    complete yet."""
    calls: list[ParsedCall] = []
    while True:
        call = read_call_object(text, pos)
        parsed = json_call(call, partial)
        if parsed is None:
            return (calls, None) if partial and call is not None else None
        if not call.complete:
            return (calls if whole_calls else [*calls, parsed]), None
        calls.append(parsed)
        pos = skip_ws(text, call.end)
        if pos >= len(text):
            return (calls, None) if partial else None
        if text[pos] == "]":
            return calls, pos + 1
        if text[pos] != ",":
            return None
        pos += 1


class _Mistral(ToolFormat):
    """Reads either shape after each ``[TOOL_CALLS]``."""

    def parse(self, text: str, partial: bool):
        start = text.find(TOOL_CALLS)
        if start < 0:
            return safe_content(text, partial, TOOL_CALLS), []
        content, calls, pos = text[:start], [], start
        while text.startswith(TOOL_CALLS, pos):
            pos = skip_ws(text, pos + len(TOOL_CALLS))
            if pos >= len(text):
                return (safe_content(content, True), calls) if partial else (content, None)
            if text[pos] == "[":
                read = read_call_list(text, pos + 1, partial, whole_calls=True)
            else:
                read = self._named(text, pos, partial)
            if read is None:
                return content, None
            more, pos = read
            calls.extend(more)
            if pos is None:
                return safe_content(content, True), calls
            pos = skip_ws(text, pos)
        # what follows the calls is not read: the templates end the turn after them
        return safe_content(content, partial), calls

    @staticmethod
    def _named(text: str, pos: int, partial: bool):
        """``NAME[CALL_ID]ID[ARGS]{...}`` from ``pos``: ([call], index after it); the index None
        while it is cut off; None when broken."""
        bracket = text.find("[", pos)
        if bracket < 0:
            return ([], None) if partial else None
        name = text[pos:bracket].strip()
        if not name or any(c.isspace() or c in "{}\"" for c in name):
            return None
        call_id, rest = None, text[bracket:]
        if rest.startswith(CALL_ID):
            id_end = text.find("[", bracket + len(CALL_ID))
            if id_end < 0:
                return ([], None) if partial else None
            call_id, bracket, rest = text[bracket + len(CALL_ID):id_end].strip(), id_end, text[id_end:]
        if not rest.startswith(ARGS):
            waiting = partial and (ARGS.startswith(rest) or (call_id is None and CALL_ID.startswith(rest)))
            return ([], None) if waiting else None
        args, end, complete = read_object(text, bracket + len(ARGS))
        if args is None:
            return None
        if not complete:
            return ([ParsedCall(name, args, call_id)], None) if partial else None
        return [ParsedCall(name, args, call_id)], end


class MistralNemo(_Mistral):
    name = "mistral-nemo"
    description = '[TOOL_CALLS][{"name": ..., "arguments": {...}, "id": ...}] (Mistral Nemo, Mistral 7B v0.3)'
    call_tail = "}]"

    def detect(self, template: str) -> int:
        return 15 if TOOL_CALLS + "[" in template else 0

    def call_lead(self, name: str) -> str:
        return f'{TOOL_CALLS}[{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": '


class Mistral(_Mistral):
    name = "mistral"
    description = "[TOOL_CALLS]NAME[CALL_ID]id[ARGS]{...} (Mistral Small 3.2, Ministral 3, Magistral, Devstral)"

    def detect(self, template: str) -> int:
        return 15 if TOOL_CALLS in template and ARGS in template else 0

    def call_lead(self, name: str) -> str:
        return f"{TOOL_CALLS}{name}{ARGS}"


#: Magistral's and Ministral 3's thinking span
THINK = ReasoningFormat("mistral", "[THINK]", "[/THINK]", "[THINK]...[/THINK] (Magistral, Ministral 3 Reasoning)")

FORMATS = (MistralNemo(), Mistral(), THINK)
