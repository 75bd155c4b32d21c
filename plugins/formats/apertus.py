"""Swiss AI Apertus: calls as ``<|tools_prefix|>[{"NAME": {args}}, ...]<|tools_suffix|>`` (the
function's name is the object's one key), reasoning as ``<|inner_prefix|>...<|inner_suffix|>``.

The arguments are the model's own text of the object, so a partial read's are a prefix of the
whole read's. As with Hermes, the calls end the reply."""

from __future__ import annotations

import json

from superfluid.core.formats.family import ReasoningFormat, ToolFormat, safe_content
from superfluid.core.formats.jsonscan import read_object, skip_ws, value_end
from superfluid.core.formats.reply import ParsedCall

OPEN, CLOSE = "<|tools_prefix|>", "<|tools_suffix|>"


def _read_calls(text: str, pos: int, partial: bool) -> tuple[list[ParsedCall], bool] | None:
    """The ``[{"NAME": {...}}, ...]`` list at ``pos``: (calls, finished), None if it is not one.
    A whole read that ends right after a complete call takes the list as closed (a stop string
    may have cut it)."""
    calls: list[ParsedCall] = []
    pos = skip_ws(text, pos)
    if pos >= len(text):
        return calls, False
    if text[pos] != "[":
        return None
    pos += 1
    while True:
        pos = skip_ws(text, pos)
        if pos >= len(text):
            return calls, False
        if text[pos] != "{":
            return None
        pos = skip_ws(text, pos + 1)
        key_end = value_end(text, pos)
        if key_end is None:  # the name is cut off (or is not a string: the whole read says)
            return (calls, False) if text[pos:pos + 1] in ('"', "") else None
        name = json.loads(text[pos:key_end])
        pos = skip_ws(text, key_end)
        if not isinstance(name, str) or text[pos:pos + 1] not in (":", ""):
            return None
        if pos >= len(text):
            return calls, False
        args, pos, complete = read_object(text, pos + 1)
        if args is None:
            return None
        calls.append(ParsedCall(name, args))
        if not complete:
            return calls, False
        pos = skip_ws(text, pos)
        if text[pos:pos + 1] != "}":
            return (calls, False) if pos >= len(text) else None
        pos = skip_ws(text, pos + 1)
        if pos >= len(text):
            return calls, not partial
        if text[pos] == "]":
            return calls, True
        if text[pos] != ",":
            return None
        pos += 1


class Apertus(ToolFormat):
    name = "apertus"
    description = '<|tools_prefix|>[{"NAME": {...}}]<|tools_suffix|> (Apertus)'
    reasoning = "apertus"
    call_tail = "}]" + CLOSE
    call_stop = CLOSE

    def detect(self, template: str) -> int:
        return 30 if OPEN in template else 0

    def call_lead(self, name: str) -> str:
        return f"{OPEN}[{{{json.dumps(name, ensure_ascii=False)}: "

    def parse(self, text: str, partial: bool):
        start = text.find(OPEN)
        if start < 0:
            return safe_content(text, partial, OPEN), []
        content = text[:start]
        read = _read_calls(text, start + len(OPEN), partial)
        if read is None:
            return content, None
        calls, finished = read
        if not finished and not partial:
            return content, None
        return safe_content(content, partial), calls


APERTUS_INNER = ReasoningFormat("apertus", "<|inner_prefix|>", "<|inner_suffix|>",
                                "<|inner_prefix|>...<|inner_suffix|> (Apertus)")

FORMATS = (Apertus(), APERTUS_INNER)
