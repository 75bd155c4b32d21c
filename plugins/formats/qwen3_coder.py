"""Qwen3-Coder's XML calls: parameters as tags, string values written raw.

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

Qwen3-Coder writes calls this way, and so do Nemotron 3 and Step 3.5 (their templates write the
same tags). A string is the value's own text; any other value is JSON (the templates write objects
and lists with ``tojson``). Reading has no schema, so a value that parses as a JSON number,
``true``/``false``/``null``, object or list is read as that value, anything else as a string.

A parameter enters the arguments once its closing tag is read, so a streamed call's arguments grow
a parameter at a time (:func:`~superfluid.core.formats.reply.partial_arguments_json`)."""

from __future__ import annotations

import json

from superfluid.core.formats.family import ToolFormat, safe_content
from superfluid.core.formats.jsonscan import skip_ws
from superfluid.core.formats.reply import ParsedCall, arguments_json, partial_arguments_json
from superfluid.core.request import JsonChoice, text_value

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
FUNCTION_OPEN, FUNCTION_CLOSE = "<function=", "</function>"
PARAMETER_OPEN, PARAMETER_CLOSE = "<parameter=", "</parameter>"
#: what may end a parameter's value: its closing tag, or (when a model leaves that out, as a
#: grammar's pieces written without their closings do) the next parameter or the function's end
_VALUE_ENDS = (PARAMETER_CLOSE, PARAMETER_OPEN, FUNCTION_CLOSE)


def xml_text(raw: str) -> str:
    """A string parameter's value: its text, less the line break each side that is layout."""
    if raw.startswith("\n"):
        raw = raw[1:]
    return raw[:-1] if raw.endswith("\n") else raw


def xml_value(raw: str):
    """A parameter's value from its text between the tags (one line break each side is layout):
    JSON when it is a JSON value other than a string, else the text itself."""
    if raw.startswith("\n"):
        raw = raw[1:]
    if raw.endswith("\n"):
        raw = raw[:-1]
    stripped = raw.strip()
    if stripped[:1] in ("{", "[", "-") or stripped[:1].isdigit() or stripped in ("true", "false", "null"):
        try:
            return json.loads(stripped)
        except ValueError:
            pass
    return raw


def _is_text(schema: dict) -> bool:
    """A property the grammar writes as raw text: a plain string (the templates write strings raw)."""
    return isinstance(schema, dict) and schema.get("type") == "string"


class Qwen3Coder(ToolFormat):
    name = "qwen3-coder"
    reads_raw_values = True
    description = "<tool_call><function=NAME><parameter=P>value</parameter></function></tool_call> " \
                  "(Qwen3-Coder, Nemotron 3, Step 3.5)"
    call_tail = FUNCTION_CLOSE + "\n" + CALL_CLOSE
    call_stop = FUNCTION_CLOSE

    def detect(self, template: str) -> int:
        # above Hermes (10): these templates also write <tool_call>
        return 20 if all(m in template for m in (CALL_OPEN, FUNCTION_OPEN, PARAMETER_OPEN)) else 0

    def call_choice(self, function: dict) -> JsonChoice:
        """The call's opening, then one piece per property in the schema's order (optional ones
        may be left out), each ``<parameter=P>`` + its value + its closing tag."""
        schema = function.get("parameters") or {}
        required = set(schema.get("required") or ())
        pieces = []
        for key, prop in (schema.get("properties") or {}).items():
            close = JsonChoice("\n" + PARAMETER_CLOSE + "\n", None)
            pieces.append(JsonChoice(f"{PARAMETER_OPEN}{key}>\n", text_value(prop) if _is_text(prop) else prop,
                                     (close,), optional=key not in required))
        return JsonChoice(f"{CALL_OPEN}\n{FUNCTION_OPEN}{function['name']}>\n", None, tuple(pieces))

    def parse(self, text: str, partial: bool):
        starts = [i for i in (text.find(CALL_OPEN), text.find(FUNCTION_OPEN)) if i >= 0]
        if not starts:
            return safe_content(text, partial, CALL_OPEN, FUNCTION_OPEN), []
        content, calls, pos = text[:min(starts)], [], min(starts)
        while True:
            if text.startswith(CALL_OPEN, pos):
                pos = skip_ws(text, pos + len(CALL_OPEN))
            if not text.startswith(FUNCTION_OPEN, pos):
                if partial and FUNCTION_OPEN.startswith(text[pos:]):
                    return safe_content(content, True), calls  # the call's name is still to come
                return content, None
            call, pos = self._call(text, pos + len(FUNCTION_OPEN), partial)
            if call is None:
                return content, None
            if call is not False:
                calls.append(call)
            if pos is None:  # cut off: what was read so far
                return safe_content(content, True), calls
            pos = skip_ws(text, pos)
            if text.startswith(CALL_CLOSE, pos):
                pos = skip_ws(text, pos + len(CALL_CLOSE))
            if not (text.startswith(CALL_OPEN, pos) or text.startswith(FUNCTION_OPEN, pos)):
                # what follows the last call is not read (the templates end the turn there); a
                # partial read only waits in case it becomes another call
                return safe_content(content, partial), calls

    def _call(self, text: str, pos: int, partial: bool):
        """One call from after ``<function=``: (call, index after ``</function>``, or the end of a
        whole reply that stops before it); (call or False when its name is not complete, None)
        when the text is cut off (partial); (None, None) when it is broken."""
        end = text.find(">", pos)
        if end < 0:
            return (False, None) if partial else (None, None)
        name = text[pos:end].strip()
        if not name or "\n" in name or "<" in name:
            return None, None
        args: dict = {}
        pos = end + 1
        while True:
            pos = skip_ws(text, pos)
            if text.startswith(FUNCTION_CLOSE, pos):
                return ParsedCall(name, arguments_json(args)), pos + len(FUNCTION_CLOSE)
            if pos >= len(text) and not partial:  # the reply ends the call (stopped at </function>)
                return ParsedCall(name, arguments_json(args)), pos
            if text.startswith(PARAMETER_OPEN, pos):
                key_end = text.find(">", pos)
                value_end = self._value_end(text, key_end + 1) if key_end >= 0 else None
                if value_end is not None:
                    key = text[pos + len(PARAMETER_OPEN):key_end].strip()
                    if not key:
                        return None, None
                    raw = text[key_end + 1:value_end]
                    args[key] = xml_text(raw) if self.is_string(name, key) else xml_value(raw)
                    pos = value_end
                    if text.startswith(PARAMETER_CLOSE, pos):
                        pos += len(PARAMETER_CLOSE)
                    continue
            elif not (partial and any(m.startswith(text[pos:]) for m in (FUNCTION_CLOSE, PARAMETER_OPEN))):
                return None, None
            if not partial:
                return None, None
            return ParsedCall(name, partial_arguments_json(args) if args else ""), None

    @staticmethod
    def _value_end(text: str, pos: int) -> int | None:
        """Where the value starting at ``pos`` ends (None: not yet)."""
        ends = [i for i in (text.find(m, pos) for m in _VALUE_ENDS) if i >= 0]
        return min(ends) if ends else None


FORMATS = (Qwen3Coder(),)
