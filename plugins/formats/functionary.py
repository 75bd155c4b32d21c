"""MeetKai Functionary v3.1 (Llama 3.1) and v3.2: two syntaxes, one family.

v3.1 writes ``<function=NAME>{json}</function>`` per call, and the code interpreter as
``<|python_tag|>`` followed by the code (or its arguments object) to the end of the reply.

v3.2 writes each part of a reply after ``>>>`` and a recipient line: ``>>>all\\n`` then text for
the user, ``>>>NAME\\n{json}`` for a call (``>>>python\\n`` then raw code for the interpreter). Its
generation prompt ends with ``>>>``, so a reply starts at the first recipient's name. Its template
writes a call's ``arguments`` as given, so it wants them as the JSON string (an object fails).

Raw code becomes the arguments ``{"code": ...}``, as llama.cpp reads it; while it streams the
arguments are that JSON without its closing ``"}``, a prefix of the whole read's."""

from __future__ import annotations

import re

from superfluid.core.formats.family import ToolFormat, partial_marker, safe_content
from superfluid.core.formats.jsonscan import read_object, skip_ws
from superfluid.core.formats.reply import ParsedCall, arguments_json

FUNCTION, FUNCTION_END, PYTHON_TAG = "<function=", "</function>", "<|python_tag|>"
SEPARATOR = ">>>"
_NAME = re.compile(r"[\w.-]+")
_RECIPIENT, _WORD = re.compile(r"(\w+)\n"), re.compile(r"\w*")


def code_call(code: str, partial: bool) -> ParsedCall:
    """The interpreter's call for raw ``code`` (trailing whitespace is not part of it, so a
    partial read cannot send what the whole read will drop)."""
    text = arguments_json({"code": code.strip()})
    return ParsedCall("python", text[:-2] if partial else text)


def object_or_code(text: str, pos: int, end: int, partial: bool) -> tuple[ParsedCall | None, bool]:
    """The interpreter's call from ``text[pos:end]``: its arguments object if it starts with one,
    else raw code. (call, finished); call None: an object that does not parse. ``partial``: the
    call may go on after ``end``."""
    start = skip_ws(text, pos)
    if partial and start >= end:
        return ParsedCall("python", ""), False  # object or code: not known yet
    if text[start:start + 1] == "{":
        args, _, complete = read_object(text[:end], start)
        if args is None or (not complete and not partial):
            return None, True
        return ParsedCall("python", args), complete
    return code_call(text[pos:end], partial), not partial


class FunctionaryV31(ToolFormat):
    name = "functionary-v3.1"
    description = "<function=NAME>{json}</function>, <|python_tag|>code (Functionary v3.1 Llama 3.1)"
    call_tail = FUNCTION_END
    call_stop = FUNCTION_END

    def detect(self, template: str) -> int:
        # Qwen3-Coder, Seed-OSS and their kin also write <function=, but with <parameter= inside
        return 30 if FUNCTION in template and FUNCTION_END in template and "<parameter=" not in template else 0

    def call_lead(self, name: str) -> str:
        return f"{FUNCTION}{name}>"

    def parse(self, text: str, partial: bool):
        starts = [i for i in (text.find(FUNCTION), text.find(PYTHON_TAG)) if i >= 0]
        if not starts:
            return safe_content(text, partial, FUNCTION, PYTHON_TAG), []
        content, calls, pos = text[:min(starts)], [], min(starts)
        while True:
            if text.startswith(PYTHON_TAG, pos):  # the interpreter's code runs to the end
                call, finished = object_or_code(text, pos + len(PYTHON_TAG), len(text), partial)
                if call is None:
                    return content, None
                calls.append(call)
                return safe_content(content, partial or not finished), calls
            if not text.startswith(FUNCTION, pos):
                break  # the calls are over: what follows is not content (as with Hermes)
            head = pos + len(FUNCTION)
            close = text.find(">", head)
            if close < 0 or not _NAME.fullmatch(text, head, close):
                if partial and close < 0 and (head == len(text) or _NAME.fullmatch(text, head)):
                    return safe_content(content, True), calls  # the name is still being written
                return content, None
            args, end, complete = read_object(text, close + 1)
            if args is None or (not complete and not partial):
                return content, None
            calls.append(ParsedCall(text[head:close], args))
            if not complete:
                return safe_content(content, True), calls
            pos = skip_ws(text, end)
            if text.startswith(FUNCTION_END, pos):
                pos = skip_ws(text, pos + len(FUNCTION_END))
        return safe_content(content, partial), calls


class FunctionaryV32(ToolFormat):
    name = "functionary-v3.2"
    description = ">>>NAME\\n{json} per call, >>>all\\n for text (Functionary v3.2)"

    def detect(self, template: str) -> int:
        return 30 if SEPARATOR + "all" in template else 0

    def call_lead(self, name: str) -> str:
        return f"{name}\n"  # the generation prompt wrote the ">>>"

    def parse(self, text: str, partial: bool):
        if partial and text and SEPARATOR.startswith(text) and text != SEPARATOR:
            return "", []
        pos = len(SEPARATOR) if text.startswith(SEPARATOR) else 0
        content, calls, first = "", [], True
        while pos < len(text):
            match = _RECIPIENT.match(text, pos)
            if match is None:
                if partial and _WORD.fullmatch(text, pos):
                    return content.rstrip(), calls  # the recipient is still being written
                if first:  # not in this syntax at all: a plain reply
                    return safe_content(text, partial, SEPARATOR), []
                break
            name, pos = match.group(1), match.end()
            nxt = text.find(SEPARATOR, pos)
            # the part runs to the next separator; while it streams, not into one being written
            end = nxt if nxt >= 0 else len(text) - (partial_marker(text[pos:], SEPARATOR) if partial else 0)
            if name == "all":
                if nxt < 0:
                    return content + safe_content(text[pos:], partial, SEPARATOR), calls
                content += text[pos:end]
            else:
                start = skip_ws(text, pos)
                if start == len(text) and partial:
                    return content.rstrip(), calls  # the call's body is not written yet
                if name == "python":
                    call, finished = object_or_code(text, pos, end, partial and nxt < 0)
                    if call is None:
                        return (text, None) if first else (content, None)
                else:
                    args, _, finished = read_object(text[:end], pos)
                    if args is None or (not finished and not partial):
                        return (text, None) if first else (content, None)
                    call = ParsedCall(name, args)
                calls.append(call)
                if not finished:
                    return content.rstrip(), calls
            if nxt < 0:
                break
            pos, first = nxt + len(SEPARATOR), False
        return (content.rstrip() if partial else content), calls


FORMATS = (FunctionaryV31(), FunctionaryV32())
