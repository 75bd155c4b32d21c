"""Kimi-K2: ``<|tool_calls_section_begin|>`` around calls written
``<|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{json}<|tool_call_end|>``, then
``<|tool_calls_section_end|>``.

The head ``functions.NAME:IDX`` is the call's id as Kimi's templates write it back (``## Return
of functions.NAME:0``), so it is kept as :attr:`ParsedCall.id`; the name is what lies between the
namespace and the index. (Kimi's published templates call ``list.append``, which the sandboxed
Jinja environment refuses, as transformers' does: they cannot be rendered as published.)"""

from __future__ import annotations

from ._tagged import MarkedJson

SECTION_BEGIN, SECTION_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
CALL_BEGIN, ARGS_BEGIN, CALL_END = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"


class KimiK2(MarkedJson):
    name = "kimi-k2"
    description = "<|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{json}<|tool_call_end|> (Kimi-K2)"
    section_open, section_close, call_open = SECTION_BEGIN, SECTION_END, CALL_BEGIN
    args_open, call_close = ARGS_BEGIN, CALL_END
    call_tail = CALL_END + SECTION_END
    call_stop = CALL_END

    def detect(self, template: str) -> int:
        return 30 if SECTION_BEGIN in template else 0

    def read_head(self, head: str):
        """``functions.NAME:IDX`` (the namespace and index optional): (NAME, the whole head as id)."""
        call_id = head.strip()
        name = call_id.removeprefix("functions.")
        stem, colon, index = name.rpartition(":")
        if colon and index.isdigit():
            name = stem
        return (name, call_id) if name else None

    def call_lead(self, name: str) -> str:
        return f"{SECTION_BEGIN}{CALL_BEGIN}functions.{name}:0{ARGS_BEGIN}"


FORMATS = (KimiK2(),)
