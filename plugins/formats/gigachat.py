"""Sber GigaChat 3 and 3.1: one call per reply, a JSON object ``{"name": ..., "arguments": {...}}``.

GigaChat 3 writes the call as a message of its own role after the answer's:
``answer<|message_sep|>\\n\\nfunction call<|role_sep|>\\n{json}``. GigaChat 3.1 writes it inside the
answer's message: ``answer<|function_call|>{json}``. Both formats read both forms (a model may mix
them up); they differ in how a forced call is written and in what their templates show.

``<|message_sep|>`` ends a message: at the end of a reply it is not content."""

from __future__ import annotations

import json

from superfluid.core.formats.family import ToolFormat, safe_content
from superfluid.core.formats.reply import ParsedCall
from superfluid.core.formats.jsonscan import read_call_object

MESSAGE_SEP, ROLE_SEP, FUNCTION_CALL = "<|message_sep|>", "<|role_sep|>", "<|function_call|>"
CALL_ROLE = "function call" + ROLE_SEP
CALL_MESSAGE = MESSAGE_SEP + "\n\n" + CALL_ROLE


def _content(text: str) -> str:
    """The answer before a call (or the whole reply): without the message's closing separator."""
    head = text.rstrip()
    return head[:-len(MESSAGE_SEP)] if head.endswith(MESSAGE_SEP) else text


class _GigaChat(ToolFormat):
    opening: str

    def call_lead(self, name: str) -> str:
        return f'{self.opening}{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": '

    call_tail = "}"

    def parse(self, text: str, partial: bool):
        found = [(i, m) for i, m in ((text.find(CALL_ROLE), CALL_ROLE), (text.find(FUNCTION_CALL), FUNCTION_CALL))
                 if i >= 0]
        if not found:
            content = _content(safe_content(text, partial, CALL_MESSAGE, CALL_ROLE, FUNCTION_CALL))
            return (content.rstrip() if partial else content), []
        start, marker = min(found)
        content = _content(text[:start])
        call = read_call_object(text, start + len(marker))
        if call is None or (call.name is None and not partial) or (not call.complete and not partial):
            return text[:start], None
        if call.name is None:
            return safe_content(content, True), []
        args = call.arguments if call.arguments is not None else ("{}" if call.complete else "")
        # what follows the call (the message separator, an end of turn) is not content
        return safe_content(content, partial), [ParsedCall(call.name, args)]


class GigaChat3(_GigaChat):
    name = "gigachat3"
    description = 'answer<|message_sep|>\\n\\nfunction call<|role_sep|>\\n{"name": ..., "arguments": ...} (GigaChat 3)'
    opening = CALL_MESSAGE + "\n"

    def detect(self, template: str) -> int:
        return 25 if "function call" in template and ROLE_SEP in template else 0


class GigaChat31(_GigaChat):
    name = "gigachat3.1"
    description = '<|function_call|>{"name": ..., "arguments": ...} (GigaChat 3.1)'
    opening = FUNCTION_CALL

    def detect(self, template: str) -> int:
        return 30 if FUNCTION_CALL in template else 0


FORMATS = (GigaChat3(), GigaChat31())
