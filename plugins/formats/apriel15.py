"""Apriel 1.5 and 1.6: the calls as one JSON list in ``<tool_calls>`` tags,
``<tool_calls>[{"name": ..., "arguments": {...}}, ...]</tool_calls>``, after any content.

1.5's template also writes ``<tool_call>`` (in its instructions), which Hermes would take for its
own; the list tags are this family's. The reasoning span is :mod:`.apriel`'s."""

from __future__ import annotations

import json

from superfluid.core.formats.family import ToolFormat, safe_content
from superfluid.core.formats.jsonscan import skip_ws
from superfluid.plugins.formats.mistral import read_call_list

OPEN, CLOSE = "<tool_calls>", "</tool_calls>"


class Apriel15(ToolFormat):
    name = "apriel"
    description = '<tool_calls>[{"name": ..., "arguments": {...}}, ...]</tool_calls> (Apriel 1.5, 1.6)'
    call_tail = "}]" + CLOSE
    call_stop = CLOSE

    def detect(self, template: str) -> int:
        # above Hermes (10), whose <tool_call> the template also writes
        return 12 if OPEN + "[" in template and CLOSE in template else 0

    def call_lead(self, name: str) -> str:
        return f'{OPEN}[{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": '

    def parse(self, text: str, partial: bool):
        start = text.find(OPEN)
        if start < 0:
            return safe_content(text, partial, OPEN), []
        content, pos = text[:start], skip_ws(text, start + len(OPEN))
        if pos >= len(text):
            return (safe_content(content, True), []) if partial else (content, None)
        if text[pos] != "[":
            return content, None
        read = read_call_list(text, pos + 1, partial)
        if read is None:
            return content, None
        calls, end = read
        # the closing tag and what follows are not read: the template ends the turn there
        return safe_content(content, partial or end is None), calls


FORMATS = (Apriel15(),)
