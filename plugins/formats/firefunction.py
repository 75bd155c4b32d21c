"""Firefunction v2: the calls as one JSON list after ``functools``,
`` functools[{"name": ..., "arguments": {...}}, ...]``, after any content, with no closing marker.

Its template needs a ``functions`` variable (the tools' JSON, which the caller passes as a
template kwarg) and a ``datetime`` one, and always ends with the assistant header, whatever
``add_generation_prompt`` says."""

from __future__ import annotations

import json

from superfluid.core.formats.family import ToolFormat, safe_content
from superfluid.plugins.formats.mistral import read_call_list

MARKER = "functools["


class Firefunction(ToolFormat):
    name = "firefunction-v2"
    description = 'functools[{"name": ..., "arguments": {...}}, ...] (Firefunction v2)'
    call_tail = "}]"

    def detect(self, template: str) -> int:
        # above Llama 3 (8-10): the template is Llama 3's with its own call marker
        return 20 if MARKER in template else 0

    def call_lead(self, name: str) -> str:
        # the template writes a space before the marker, so the model does too
        return f' {MARKER}{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": '

    def parse(self, text: str, partial: bool):
        start = text.find(MARKER)
        if start < 0:
            return safe_content(text, partial, MARKER), []
        content = text[:start]
        read = read_call_list(text, start + len(MARKER), partial)
        if read is None:
            return content, None
        calls, end = read
        # what follows the list is not read: the template ends the turn after it
        return safe_content(content, partial or end is None), calls


FORMATS = (Firefunction(),)
