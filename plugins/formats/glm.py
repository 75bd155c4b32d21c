"""GLM-4.5 / 4.6: ``<tool_call>NAME`` then ``<arg_key>K</arg_key><arg_value>V</arg_value>`` per
argument, then ``</tool_call>``; one block per call, reasoning in ``<think>``.

Values are raw text for strings and JSON otherwise (the template's ``v | tojson if v is not
string``), read back by :func:`~._tagged.text_or_json`. The template also holds ``<tool_call>``,
which Hermes scores 10; ``<arg_key>`` is GLM's alone, so this format scores higher."""

from __future__ import annotations

import re

from ._tagged import TaggedParams

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_KEY = re.compile(r"(.+?)</arg_key>\s*", re.S)


class Glm45(TaggedParams):
    name = "glm-4.5"
    description = "<tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value></tool_call> (GLM-4.5, GLM-4.6)"
    reasoning = "think"
    call_open, call_close = OPEN, CLOSE
    param_open, param_head_end, value_close = "<arg_key>", "<arg_value>", "</arg_value>"
    call_tail = "\n" + CLOSE
    call_stop = CLOSE

    def detect(self, template: str) -> int:
        return 25 if "<arg_key>" in template and OPEN in template else 0

    def read_name(self, text: str, pos: int):
        """The name runs to the end of its line (or the first tag, when the model writes none)."""
        ends = [i for i in (text.find("\n", pos), text.find("<", pos)) if i >= 0]
        return (text[pos:min(ends)].strip(), min(ends)) if ends else None

    def param_key(self, head: str):
        """``K</arg_key>`` (then whitespace): the text between ``<arg_key>`` and ``<arg_value>``."""
        match = _KEY.fullmatch(head)
        return (match.group(1).strip(), None) if match else None

    def call_lead_text(self, name: str) -> str:
        return OPEN + name

    def param_lead(self, key: str, is_string: bool) -> str:
        return f"\n<arg_key>{key}</arg_key>\n<arg_value>"


FORMATS = (Glm45(),)
