"""Reasoning models' replies split into their reasoning and their answer, as the text streams.

Reasoning models (Qwen3, DeepSeek-R1 and its distills) open their reply with a span between two
markers, ``<think>…</think>``, then answer. :class:`ReasoningParser` is fed the reply's text
deltas as the model makes them and returns, per delta, the part that is reasoning and the part
that is answer (content), never a marker nor a piece of one: text that could still be the start
of a marker split across deltas (``<thi`` then ``nk>``) is held back until the next delta says
what it is. No HTTP here: the front ends place the two parts where their API puts them.

- A reply that does not open the span (after leading whitespace) is all content.
- A reply cut off inside the span (its length limit) leaves the span's text as reasoning.
- Some templates open the span in the prompt (Qwen3's and DeepSeek-R1's generation prompt may
  end with ``<think>\\n``): such a reply starts inside it (``inside=True``); a start marker the
  model writes again anyway is dropped.
- Whitespace next to the markers (the newlines after ``<think>`` and around ``</think>``) is
  trimmed; text after the end marker is content as it comes, a second span included.

The markers are a parameter (:class:`Markers`). Which span a model's replies have is its chat
format's (:mod:`superfluid.core.formats`): the serving path reads replies through
:class:`~superfluid.core.formats.reader.ReplyReader`; this parser follows a span token by token,
which is how a reply's reasoning tokens are counted."""

from __future__ import annotations

import attrs


@attrs.frozen
class Markers:
    """The text that opens and the text that closes a reasoning span."""

    start: str
    end: str


THINK = Markers("<think>", "</think>")  # Qwen3, QwQ, DeepSeek-R1 and its distills


_OPENING, _INSIDE, _CLOSED = "opening", "inside", "closed"


def _partial(text: str, marker: str) -> int:
    """How many characters at the end of ``text`` could begin ``marker`` (a proper prefix)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


class ReasoningParser:
    """One reply's parser. ``inside``: the prompt opened the span (the reply starts in it)."""

    def __init__(self, markers: Markers = THINK, inside: bool = False):
        self.markers = markers
        self.inside_at_start = inside
        self.state = _OPENING
        self.opened = inside  # the span is open (or was): text before its end is reasoning
        self.buf = ""
        self.trim = True  # whitespace at the start of the current part is dropped

    @property
    def in_span(self) -> bool:
        """The reply is inside the reasoning span now (or may be, at its start)."""
        return self.state == _INSIDE or (self.state == _OPENING and self.opened)

    def feed(self, text: str) -> tuple[str, str]:
        """(reasoning, content) of one more delta of the reply."""
        self.buf += text
        reasoning, content = [], []
        while True:
            if self.state == _OPENING:
                head = self.buf.lstrip()
                if head.startswith(self.markers.start):  # the span opens (or opens again: dropped)
                    self.buf = head[len(self.markers.start):]
                    self.state, self.opened, self.trim = _INSIDE, True, True
                    continue
                if not head or self.markers.start.startswith(head):
                    break  # whitespace, or what may still become the start marker: wait
                self.state = _INSIDE if self.opened else _CLOSED
                self.trim = True
                continue
            if self.state == _INSIDE:
                if self.trim:
                    self.buf = self.buf.lstrip()
                end = self.buf.find(self.markers.end)
                if end >= 0:
                    part = self.buf[:end].rstrip()
                    if part:
                        reasoning.append(part)
                    self.buf = self.buf[end + len(self.markers.end):]
                    self.state, self.trim = _CLOSED, True
                    continue
                keep = _partial(self.buf, self.markers.end)
                ready = self.buf[:len(self.buf) - keep]
                safe = ready.rstrip()  # trailing whitespace may be the last before the end marker
                if safe:
                    reasoning.append(safe)
                    self.trim = False
                self.buf = self.buf[len(safe):]
                break
            # closed: the rest is content
            if self.trim:
                self.buf = self.buf.lstrip()
                if not self.buf:
                    break
                self.trim = False
            content.append(self.buf)
            self.buf = ""
            break
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        """(reasoning, content) held back when the reply ended: a partial marker is text after
        all (inside the span: reasoning; before it: content); whitespace at the edges is dropped."""
        rest, self.buf = self.buf, ""
        if self.state == _OPENING and not self.opened:
            self.state = _CLOSED
            return "", rest.strip()
        if self.state in (_OPENING, _INSIDE):
            self.state = _CLOSED
            text = rest.strip() if self.trim else rest.rstrip()
            return text, ""
        return "", "" if self.trim else rest
