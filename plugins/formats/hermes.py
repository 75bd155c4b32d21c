"""Hermes: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, one block per call.

Hermes 2 Pro, Qwen 2.5, Qwen3 and QwQ, SmolLM3 and many fine-tunes write calls this way. A reply
that is nothing but a call object (or a list of them) is read as calls too: small models asked for
the format often leave the tags out."""

from __future__ import annotations

from superfluid.core.formats.family import ToolFormat, safe_content
from superfluid.core.formats.jsonscan import read_call_object, skip_ws
from superfluid.core.formats.reply import ParsedCall

OPEN, CLOSE = "<tool_call>", "</tool_call>"


def json_call(call, partial: bool) -> ParsedCall | None:
    """A :class:`~superfluid.core.formats.jsonscan.JsonCall` as a call, or None (no name yet, or
    cut off in a whole read)."""
    if call is None or call.name is None or (not call.complete and not partial):
        return None
    if call.complete:
        return ParsedCall(call.name, call.arguments or "{}", call.id)
    return ParsedCall(call.name, call.arguments or "", call.id)


class Hermes(ToolFormat):
    name = "hermes"
    description = "<tool_call>{json}</tool_call> (Hermes 2 Pro, Qwen 2.5, Qwen3, QwQ, SmolLM3)"
    reasoning = None
    call_tail = "}\n" + CLOSE
    call_stop = CLOSE

    def detect(self, template: str) -> int:
        return 10 if OPEN in template and "<function=" not in template else 0

    def call_lead(self, name: str) -> str:
        import json
        return f'{OPEN}\n{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": '

    def parse(self, text: str, partial: bool):
        start = text.find(OPEN)
        if start < 0:
            head = text.lstrip()
            if head[:1] in ("{", "["):  # a bare call object, or a list of them
                return self._bare(text, partial)
            return safe_content(text, partial, OPEN), []
        content, calls, pos = text[:start], [], start
        while text.startswith(OPEN, pos):
            call = read_call_object(text, pos + len(OPEN))
            parsed = json_call(call, partial)
            if parsed is None:
                if partial and call is not None:  # not far enough to name the call yet
                    return safe_content(content, True), calls
                return content, None  # broken: the reply is content as written
            calls.append(parsed)
            if not call.complete:
                return safe_content(content, True), calls
            pos = skip_ws(text, call.end)
            if text.startswith(CLOSE, pos):
                pos = skip_ws(text, pos + len(CLOSE))
            elif partial and CLOSE.startswith(text[pos:]):
                return safe_content(content, True), calls
        return safe_content(content, partial), calls

    def _bare(self, text: str, partial: bool):
        pos = skip_ws(text, 0)
        listed = text[pos] == "["
        pos = pos + 1 if listed else pos
        calls = []
        while True:
            call = read_call_object(text, pos)
            parsed = json_call(call, partial)
            if parsed is None:
                if partial and call is not None:
                    return "", calls
                return text, None
            calls.append(parsed)
            if not call.complete:
                return "", calls
            pos = skip_ws(text, call.end)
            if listed and text.startswith(",", pos):
                pos += 1
                continue
            if listed and text.startswith("]", pos):
                pos = skip_ws(text, pos + 1)
            if pos < len(text):
                return (text, None) if not partial else ("", calls)
            return "", calls


FORMATS = (Hermes(),)
