"""IBM Granite 3.x: calls as ``<|tool_call|>[{"name": ..., "arguments": {...}}, ...]``, reasoning
as ``<think>...</think>`` followed by the answer in ``<response>...</response>``.

The Granite 3.3 template never writes an assistant's calls back (an assistant turn is its content
alone), so a conversation's calls cannot be checked by rendering them: the syntax here is the one
its system prompt asks for ("respond only with <|tool_call|> followed by a JSON list") and the one
llama.cpp's Granite handler reads. Granite 4.0 writes Hermes' ``<tool_call>`` tags and is read by
:mod:`.hermes`: its template has no ``<|tool_call|>``."""

from __future__ import annotations

from superfluid.core.formats.family import ReasoningFormat, partial_marker

from ._json_list import JsonListCalls

TOOL_CALL = "<|tool_call|>"
RESPONSE, RESPONSE_END = "<response>", "</response>"


class Granite(JsonListCalls):
    name = "granite"
    description = '<|tool_call|>[{"name": ..., "arguments": {...}}] (Granite 3.x)'
    reasoning = "granite"
    open = TOOL_CALL

    def detect(self, template: str) -> int:
        return 30 if TOOL_CALL in template else 0


class GraniteReasoning(ReasoningFormat):
    """``<think>`` reasoning, then the answer wrapped in ``<response>...</response>``: the wrapper
    is taken off, so the content is the answer alone (what follows it, a call, stays)."""

    def __init__(self):
        super().__init__("granite", "<think>", "</think>",
                         "<think>...</think><response>...</response> (Granite 3.x)",
                         evidence=("<think></think>", "<response></response>"))

    def split(self, text: str, inside: bool, partial: bool) -> tuple[str, str]:
        reasoning, rest = super().split(text, inside, partial)
        head = rest.lstrip()
        if partial and head and RESPONSE.startswith(head) and head != RESPONSE:
            return reasoning, ""  # may still become the opening
        if not head.startswith(RESPONSE):
            return reasoning, rest
        inner = head[len(RESPONSE):]
        end = inner.find(RESPONSE_END)
        if end >= 0:
            return reasoning, inner[:end] + inner[end + len(RESPONSE_END):]
        if partial:
            inner = inner[:len(inner) - partial_marker(inner, RESPONSE_END)]
        return reasoning, inner


FORMATS = (Granite(), GraniteReasoning())
