"""MiniMax-M2: ``<minimax:tool_call>`` around one ``<invoke name="NAME">`` per call, each with one
``<parameter name="K">V</parameter>`` per argument; reasoning in ``<think>`` (the generation
prompt opens it).

Values are raw text for strings and JSON otherwise, as the template writes them."""

from __future__ import annotations

from ._tagged import TaggedParams

SECTION_OPEN, SECTION_CLOSE = "<minimax:tool_call>", "</minimax:tool_call>"


class MiniMaxM2(TaggedParams):
    name = "minimax-m2"
    description = '<minimax:tool_call><invoke name="NAME"><parameter name="K">V</parameter></invoke> (MiniMax-M2)'
    reasoning = "think"
    section_open, section_close = SECTION_OPEN, SECTION_CLOSE
    call_open, head_end, call_close = '<invoke name="', '">', "</invoke>"
    param_open, param_head_end, value_close = '<parameter name="', '">', "</parameter>"
    call_tail = f"\n</invoke>\n{SECTION_CLOSE}"
    call_stop = "</invoke>"

    def detect(self, template: str) -> int:
        return 30 if SECTION_OPEN in template else 0

    def call_lead_text(self, name: str) -> str:
        return f'{SECTION_OPEN}\n<invoke name="{name}">'

    def param_lead(self, key: str, is_string: bool) -> str:
        return f'\n<parameter name="{key}">'


FORMATS = (MiniMaxM2(),)
