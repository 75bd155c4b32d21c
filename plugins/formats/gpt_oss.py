"""gpt-oss: OpenAI's harmony format, where a reply is a run of messages, each a header then
``<|message|>`` then a body closed by ``<|end|>``, ``<|call|>`` or ``<|return|>``.

The header names the channel (``<|channel|>analysis``, ``commentary`` or ``final``) and, for a
call, its recipient (``to=functions.NAME``), before or after the channel: the model writes
``<|channel|>commentary to=functions.NAME <|constrain|>json``, the template writes
``to=functions.NAME<|channel|>commentary json``. Later messages open with
``<|start|>assistant``. The analysis channel is the reasoning, a message to a recipient is a call
(its body the JSON arguments), and any other message (final, or a commentary preamble) is content.
Because the reasoning is a channel like the others, this format reads it itself
(:attr:`reads_reasoning`)."""

from __future__ import annotations

import json
import re

from superfluid.core.formats.family import ToolFormat, partial_marker
from superfluid.core.formats.jsonscan import read_object, skip_ws
from superfluid.core.formats.reply import ParsedCall

START, CHANNEL, CONSTRAIN, MESSAGE = "<|start|>", "<|channel|>", "<|constrain|>", "<|message|>"
ENDS = ("<|end|>", "<|call|>", "<|return|>")
#: what a message's header may begin with (the generation prompt ends ``<|start|>assistant``)
HEAD_STARTS = (START, CHANNEL, "to=", MESSAGE)  # a message with no header (a model that is not gpt-oss) is content
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")
_CHANNEL = re.compile(re.escape(CHANNEL) + r"\s*([^\s<]+)")


def _join(parts: list[str]) -> str:
    """Bodies of one kind, trimmed, the empty ones left out: trimming both ends of each keeps a
    partial read a prefix of the whole one (a body's end is only trimmed more as it grows)."""
    return "\n".join(p for p in (part.strip() for part in parts) if p)


def _arguments(body: str, ended: bool) -> str | None:
    """A call's arguments from its body: the object as written (a prefix of it while the body
    goes on), or the object inside a JSON string (the template writes a string argument so);
    None when it is neither."""
    if body.lstrip().startswith('"'):
        if not ended:
            return ""
        try:
            inner = json.loads(body)
            return inner if isinstance(json.loads(inner), dict) else None
        except (TypeError, ValueError):
            return None
    args, end, complete = read_object(body, 0)
    if args is None or (not complete and ended) or body[end:].strip():
        return None
    return args


class GptOss(ToolFormat):
    name = "gpt-oss"
    description = "harmony channels: analysis (reasoning), commentary to=functions.NAME (calls), final (gpt-oss)"
    reads_reasoning = True
    call_tail = call_stop = "<|call|>"

    def detect(self, template: str) -> int:
        return 30 if CHANNEL in template and MESSAGE in template else 0

    def call_lead(self, name: str) -> str:
        return f"{CHANNEL}commentary to=functions.{name} {CONSTRAIN}json{MESSAGE}"

    def parse(self, text: str, partial: bool):
        _, content, calls = self.read(text, partial, False)
        return content, calls

    def read(self, text: str, partial: bool, inside: bool):
        """(reasoning, content, calls). ``inside``: the prompt opened an analysis message."""
        reasoning: list[str] = []
        content: list[str] = []
        calls: list[ParsedCall] = []
        pos = 0
        header = "<|channel|>analysis" if inside else None
        while True:
            at = pos  # where this message starts (what a broken one gives back as content)
            if header is None:  # at a message boundary: a header, or plain text
                at = skip_ws(text, pos)
                rest = text[at:]
                if not rest or (partial and any(h.startswith(rest) for h in HEAD_STARTS)):
                    break
                if not rest.startswith(HEAD_STARTS):  # text outside any message: content, to the next one
                    end = min((i for i in (text.find(START, at), text.find(CHANNEL, at)) if i >= 0), default=-1)
                    piece = text[at:] if end < 0 else text[at:end]
                    if partial and end < 0:
                        piece = piece[:len(piece) - partial_marker(piece, START, CHANNEL)]
                    content.append(piece)
                    if end < 0:
                        break
                    pos = end
                    continue
                opened = text.find(MESSAGE, at)
                if opened < 0:
                    if partial:
                        break
                    return _join(reasoning), _join([*content, text[at:]]), None
                header, pos = text[at:opened], opened + len(MESSAGE)
            ends = [(i, m) for m in ENDS if (i := text.find(m, pos)) >= 0]
            if ends:
                end, marker = min(ends)
                body, after = text[pos:end], end + len(marker)
            else:
                body, after = text[pos:], len(text)
                if partial:
                    body = body[:len(body) - partial_marker(body, *ENDS)]
            recipient = _RECIPIENT.search(header)
            channel = _CHANNEL.search(header)
            if recipient:
                args = _arguments(body, bool(ends) or not partial)
                if args is None:
                    return _join(reasoning), _join([*content, text[at:]]), None
                calls.append(ParsedCall(recipient.group(1).removeprefix("functions."), args))
            elif channel and channel.group(1) == "analysis":
                reasoning.append(body)
            else:
                content.append(body)
            if not ends:
                break
            header, pos = None, after
        return _join(reasoning), _join(content), calls


FORMATS = (GptOss(),)
