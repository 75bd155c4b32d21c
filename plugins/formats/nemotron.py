"""NVIDIA Nemotron Nano v2: calls as ``<TOOLCALL>[{"name": ..., "arguments": {...}}, ...]</TOOLCALL>``
after the reasoning, which the generation prompt opens with ``<think>\\n`` (read by the ``think``
reasoning format).

Nemotron 3 Nano writes Qwen3-Coder's XML calls (``<tool_call><function=...><parameter=...>``)
instead, and is read by that family's format."""

from __future__ import annotations

from ._json_list import JsonListCalls

OPEN, CLOSE = "<TOOLCALL>", "</TOOLCALL>"


class NemotronV2(JsonListCalls):
    name = "nemotron-v2"
    description = '<TOOLCALL>[{"name": ..., "arguments": {...}}]</TOOLCALL> (Nemotron Nano v2)'
    reasoning = "think"
    open, close = OPEN, CLOSE

    def detect(self, template: str) -> int:
        return 30 if OPEN in template and CLOSE in template else 0


FORMATS = (NemotronV2(),)
