"""Upstage Solar Open: a reply is a run of assistant blocks. ``<|think|>...<|end|>`` is the
reasoning; ``<|content|>...<|end|>`` (or ``<|flush|>``) the answer; ``<|tool_calls|>`` opens the
calls, each ``<|tool_call:begin|>ID<|tool_call:name|>NAME<|tool_call:args|>{json}<|tool_call:end|>``,
closed by ``<|calls|>``. Each block after the first is opened again by ``<|begin|>assistant``
(the generation prompt wrote the first one's).

The id is the model's own (its template asks for ten lowercase letters or digits and matches the
tool's answer to it), so it is kept; a forced call writes none (one written there would be the
same in every forced call), so the server makes one. The arguments are the model's own text.

The template renders reasoning from a message's ``reasoning`` field only, which the round trip
does not fill, so its reasoning is checked by tests/unit/test_formats_group_c.py instead."""

from __future__ import annotations

from superfluid.core.formats.family import ReasoningFormat, ToolFormat, safe_content
from superfluid.core.formats.jsonscan import read_object, skip_ws
from superfluid.core.formats.reply import ParsedCall

THINK, END, FLUSH, BEGIN = "<|think|>", "<|end|>", "<|flush|>", "<|begin|>assistant"
CONTENT, TOOL_CALLS, CALLS_END = "<|content|>", "<|tool_calls|>", "<|calls|>"
CALL_BEGIN, CALL_NAME, CALL_ARGS, CALL_END = ("<|tool_call:begin|>", "<|tool_call:name|>",
                                              "<|tool_call:args|>", "<|tool_call:end|>")


def _answer(text: str, partial: bool) -> str:
    """The content of the blocks before the calls: the ``<|content|>`` block's text, without the
    markers around it (what follows its end is another block's opening)."""
    head = text.lstrip()
    for marker in (BEGIN, CONTENT):
        if partial and head and marker.startswith(head) and head != marker:
            return ""
        if head.startswith(marker):
            head = head[len(marker):]
    ends = [i for i in (head.find(END), head.find(FLUSH)) if i >= 0]
    if ends:
        return head[:min(ends)].rstrip() if partial else head[:min(ends)]
    return safe_content(head, partial, END, FLUSH, TOOL_CALLS, BEGIN)


class SolarOpen(ToolFormat):
    name = "solar-open"
    description = "<|tool_calls|><|tool_call:begin|>ID<|tool_call:name|>NAME<|tool_call:args|>{json}... (Solar Open)"
    reasoning = "solar-open"
    call_tail = CALL_END + CALLS_END
    call_stop = CALLS_END

    def detect(self, template: str) -> int:
        return 30 if CALL_BEGIN in template else 0

    def call_lead(self, name: str) -> str:
        return f"{TOOL_CALLS}{CALL_BEGIN}{CALL_NAME}{name}{CALL_ARGS}"

    def parse(self, text: str, partial: bool):
        start = text.find(TOOL_CALLS)
        if start < 0:
            return _answer(text, partial), []
        content, calls, pos = _answer(text[:start], False), [], start + len(TOOL_CALLS)
        while True:
            pos = skip_ws(text, pos)
            if not text.startswith(CALL_BEGIN, pos):
                if partial and CALL_BEGIN.startswith(text[pos:]):
                    break  # the next call may be starting
                if not calls:
                    return content, None
                break  # <|calls|>, or what follows the calls: not content
            head = pos + len(CALL_BEGIN)
            name_at, args_at = text.find(CALL_NAME, head), text.find(CALL_ARGS, head)
            if name_at < 0 or args_at < name_at:
                if partial:
                    break  # the head is still being written
                return content, None
            name = text[name_at + len(CALL_NAME):args_at].strip()
            args, pos, complete = read_object(text, args_at + len(CALL_ARGS))
            if not name or args is None or (not complete and not partial):
                return content, None
            calls.append(ParsedCall(name, args, text[head:name_at].strip() or None))
            if not complete:
                break
            pos = skip_ws(text, pos)
            if text.startswith(CALL_END, pos):
                pos += len(CALL_END)
        return (content.rstrip() if partial else content), calls


class SolarReasoning(ReasoningFormat):
    """``<|think|>...<|end|>``, then the next block's ``<|begin|>assistant`` (taken off, so the
    rest starts at the block's kind)."""

    def __init__(self):
        super().__init__("solar-open", THINK, END, "<|think|>...<|end|> (Solar Open)",
                         evidence=(BEGIN + THINK,))

    def split(self, text: str, inside: bool, partial: bool) -> tuple[str, str]:
        reasoning, rest = super().split(text, inside, partial)
        head = rest.lstrip()
        if head.startswith(BEGIN):
            return reasoning, head[len(BEGIN):]
        if partial and head and BEGIN.startswith(head):
            return reasoning, ""
        return reasoning, rest


FORMATS = (SolarOpen(), SolarReasoning())
