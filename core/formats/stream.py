"""A reply read as it streams: per delta of generated text, the content, reasoning and call
deltas that are now certain.

Each delta re-reads the reply so far (partial) and sends what it adds to what was sent. Because a
partial read is a prefix of every later read, the deltas sum to the whole read: a streamed reply
assembles to exactly the reply sent whole. A call is sent once its name is known (with its id and
the arguments so far), then its arguments as they grow; parallel calls carry their index."""

from __future__ import annotations

import attrs

from .reader import ReplyReader
from .reply import ParsedReply, new_call_id


@attrs.frozen
class CallDelta:
    """A piece of call ``index``: its first has ``id`` and ``name``, later ones only arguments."""

    index: int
    arguments: str = ""
    id: str | None = None
    name: str | None = None

    def openai(self) -> dict:
        """As an entry of a chat chunk's ``delta.tool_calls``."""
        if self.name is not None:
            return {"index": self.index, "id": self.id, "type": "function",
                    "function": {"name": self.name, "arguments": self.arguments}}
        return {"index": self.index, "function": {"arguments": self.arguments}}


@attrs.frozen
class ReplyDelta:
    content: str = ""
    reasoning: str = ""
    calls: tuple[CallDelta, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning or self.calls)


class StreamReader:
    """Reads one reply as it streams (``reader`` says how)."""

    def __init__(self, reader: ReplyReader):
        self.reader = reader
        self.text = ""
        self.sent = ParsedReply()
        self.ids: list[str] = []  # the ids given to the calls sent, in order

    def feed(self, delta: str) -> ReplyDelta:
        """The deltas that the reply's next ``delta`` of text makes certain."""
        self.text += delta
        if not self.reader.active:
            return ReplyDelta(content=delta)
        return self._advance(self.reader.read(self.text, partial=True))

    def finish(self) -> tuple[ReplyDelta, ParsedReply]:
        """(what is left to send, the whole reply read) once the reply has ended."""
        whole = self.reader.read(self.text) if self.reader.active else ParsedReply(self.text)
        return self._advance(whole), whole

    def _advance(self, now: ParsedReply) -> ReplyDelta:
        sent = self.sent
        content = now.content[len(sent.content):] if now.content.startswith(sent.content) else ""
        reasoning = now.reasoning[len(sent.reasoning):] if now.reasoning.startswith(sent.reasoning) else ""
        calls, kept = [], list(sent.calls)
        for i, call in enumerate(now.calls):
            if i < len(sent.calls):
                before = sent.calls[i].arguments
                if call.arguments.startswith(before) and len(call.arguments) > len(before):
                    calls.append(CallDelta(i, call.arguments[len(before):]))
                    kept[i] = call
            else:
                self.ids.append(call.id or new_call_id())
                calls.append(CallDelta(i, call.arguments, self.ids[i], call.name))
                kept.append(call)
        self.sent = ParsedReply(sent.content + content, sent.reasoning + reasoning, tuple(kept))
        return ReplyDelta(content, reasoning, tuple(calls))
