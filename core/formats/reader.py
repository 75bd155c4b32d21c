"""One reply's reading: its family's reasoning and tool-call formats, and the request's tools.

The reader is the one place that decides what a reply *is*: the formats say where the markers
are; the reader holds the calls to what the request offered. A call that names no offered tool,
or whose arguments are not a JSON object, makes the whole reply content: the model wrote it, so
it is returned, never an error."""

from __future__ import annotations

import attrs

from .family import ReasoningFormat, ToolFormat
from .reply import ParsedCall, ParsedReply


@attrs.frozen
class ReplyReader:
    """How one request's reply is read. ``tools``: the names calls may take (None: any, as
    ``superfluid template parse`` reads); ``forced``: the one name a forced call must take;
    ``inside``: the prompt opened the reasoning span; ``prefill``: text the prompt wrote for the
    model at the start of its reply (a forced call's opening), read as part of the reply."""

    tool_format: ToolFormat | None = None
    reasoning: ReasoningFormat | None = None
    tools: frozenset[str] | None = None
    forced: str | None = None
    parallel: bool = True
    inside: bool = False
    prefill: str = ""

    @property
    def active(self) -> bool:
        """Whether there is anything to read (else a reply is all content, as generated)."""
        return self.tool_format is not None or self.reasoning is not None

    def read(self, text: str, partial: bool = False) -> ParsedReply:
        """The reply ``text`` (the generated text, after :attr:`prefill`) read whole, or as far as
        it goes (``partial``)."""
        text = self.prefill + text
        fmt = self.tool_format
        if fmt is not None and fmt.reads_reasoning:
            reasoning, rest, calls = fmt.read(text, partial, self.inside)
            content = rest
        else:
            reasoning, rest = self.reasoning.split(text, self.inside, partial) if self.reasoning else ("", text)
            if fmt is None:
                content, calls = (rest.rstrip() if partial else rest), []
            else:
                content, calls = fmt.parse(rest, partial)
        calls = None if calls is None else self._held(calls, partial)
        if calls is None:  # not a call after all: the reply as written
            if partial:
                return ParsedReply(content, reasoning, ())
            return ParsedReply(rest, reasoning, ())
        if calls and not partial:
            content = content.rstrip()
        return ParsedReply(content, reasoning, tuple(calls))

    def _held(self, calls: list[ParsedCall], partial: bool) -> list[ParsedCall] | None:
        """The calls as the request allows them; None if one is not a call it could make."""
        if not self.parallel:
            calls = calls[:1]
        for i, call in enumerate(calls):
            if self.tools is not None and call.name not in self.tools:
                return None
            if self.forced is not None and call.name != self.forced:
                return None
            last = partial and i == len(calls) - 1
            if not last and not isinstance(call.arguments_object(), dict):
                return None
        return calls
