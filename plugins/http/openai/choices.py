"""The choices of one reply, each answered from its own lane's events.

A request with ``n`` > 1 runs as n lanes with the same prompt (see :mod:`..prepare.preparer`); each
:class:`Choice` keeps what its lane produced (text, tool-call parsing, logprobs) and shapes its
part of the reply: the streamed chunks of its index as its events come (interleaved with the
other choices' chunks), or its entry of ``choices`` in a reply sent whole. A one-choice reply is
the same with n = 1, so both paths are one."""

from __future__ import annotations

import attrs

from superfluid.core.formats.stream import StreamReader

from ..prepare import reply_read
from ..prepare.logprob_format import CompletionLogprobs, TokenText, chat_entries, chat_object
from .replies import Shape


class Choice:
    """Choice ``index`` of a prepared reply (``prep``: :class:`~..prepare.preparer.Prepared`)."""

    def __init__(self, index: int, prep, shape: Shape, text: TokenText):
        self.index = index
        self.prep = prep
        self.shape = shape
        self.text = text
        self.parts: list[str] = []  # the generated text, as it came
        self.thoughts: list[str] = []  # a reasoning model's reasoning, as read
        self.reasoning_tokens = 0  # tokens generated inside the reasoning span
        # the span followed token by token (whatever the deltas' grouping), to count its tokens
        thinks = getattr(prep, "reasoning", None)
        self.counter = thinks.parser() if thinks is not None and shape.kind == "chat" and not prep.score_only else None
        self.logprobs: list = []  # the generated tokens' TokenLogprobs (a reply sent whole)
        reader = getattr(prep, "reader", None)
        self.reader = reader if reader is not None and reader.active and shape.kind == "chat" \
            and not prep.score_only else None
        # a streamed chat read as it comes: content, reasoning and calls as deltas
        self.stream = StreamReader(self.reader) if self.reader is not None and prep.stream else None
        self.streamed_logprobs = (CompletionLogprobs(text, prep.logprobs)
                                  if prep.stream and shape.kind == "completion" and prep.logprobs is not None else None)
        self.event = None  # the lane's final event, once it finished
        self.parsed = None  # the reply split into content and calls (tools were offered)
        self.generated = 0  # completion tokens seen so far: what the key's tokens-per-minute is charged

    @property
    def reasoning(self) -> str:
        """A reasoning model's reasoning ("" for others)."""
        return "".join(self.thoughts)

    @property
    def reply(self) -> str:
        """The assistant's reply: the tool pre-fill ("" unless a call is forced), then the text."""
        return self.prep.tools.prefill + "".join(self.parts)

    # ---- events ----------------------------------------------------------------------------

    def delta(self, event) -> list[dict]:
        """Take a "delta" event; the chunks it makes (for a stream)."""
        if self.prep.score_only:  # the one token generated to score the prompt is not the reply's
            return []
        self.generated += len(event.token_ids)
        self._count(event.token_ids)
        self.parts.append(event.text)
        if not self.prep.stream:
            self.logprobs.extend(event.logprobs)
            return []
        logprobs = self._chunk_logprobs(event.logprobs)
        if self.stream is None:
            if not event.text and not (logprobs and event.logprobs):
                return []
            return [self.shape.chunk(text=event.text, index=self.index, logprobs=logprobs)]
        read = self.stream.feed(event.text)
        if not read and not (logprobs and event.logprobs):
            return []
        self.thoughts.append(read.reasoning)
        return [self.shape.chunk(text=read.content, index=self.index, logprobs=logprobs, reasoning=read.reasoning,
                                 tool_calls=[c.openai() for c in read.calls] or None)]

    def _count(self, token_ids) -> None:
        """Count the tokens generated inside the reasoning span (its markers included): each
        token's own text through a parser of its own, so the count does not depend on how the
        tokens were grouped into deltas."""
        if self.counter is None:
            return
        for token in token_ids:
            was_inside = self.counter.in_span
            thought, answer = self.counter.feed(self.text(token)[0])
            if (was_inside or self.counter.in_span or thought) and not answer:
                self.reasoning_tokens += 1

    def _chunk_logprobs(self, logprobs) -> dict | None:
        if self.prep.logprobs is None:
            return None
        if self.streamed_logprobs is not None:
            return self.streamed_logprobs.add(logprobs)
        return chat_object(chat_entries(logprobs, self.text, self.prep.logprobs))

    def finish(self, event) -> list[dict]:
        """Take the lane's "finished" event; the closing chunks (for a stream)."""
        if self.prep.score_only:  # as if max_tokens 0 had been run: nothing generated
            event = attrs.evolve(event, completion_tokens=0, finish_reason="length")
        self.event = event
        self.generated = max(self.generated, event.completion_tokens)
        if self.stream is not None:
            rest, whole = self.stream.finish()
            self.parsed = reply_read.parsed(whole, event.finish_reason, self.stream.ids)
        elif self.reader is not None:
            rest, self.parsed = None, reply_read.parsed(self.reader.read("".join(self.parts)), event.finish_reason)
        else:
            rest = None
        if self.parsed is not None:
            self.thoughts = [self.parsed.reasoning]
        if not self.prep.stream:
            return []
        chunks, finish = [], event.finish_reason
        if rest:
            chunks.append(self.shape.chunk(text=rest.content, index=self.index, reasoning=rest.reasoning,
                                           tool_calls=[c.openai() for c in rest.calls] or None))
        if self.parsed is not None:
            finish = self.parsed.finish_reason
        chunks.append(self.shape.chunk(finish=finish, event=event, index=self.index))
        return chunks

    # ---- shapes ----------------------------------------------------------------------------

    def opening(self) -> list[dict]:
        """A stream's first chunks of this choice: the role (chat), the echoed prompt (completion)."""
        if self.shape.kind == "chat":
            return [self.shape.chunk(role=True, index=self.index)]
        if self.prep.echo and self.streamed_logprobs is None:  # with logprobs it waits for its scores
            return [self.shape.chunk(text=self.prep.echo, index=self.index)]
        return []

    @property
    def echo_waits_for_scores(self) -> bool:
        """A streamed completion echoing its prompt with logprobs: the prompt's chunk (and every
        chunk after it) waits for the "scored" event."""
        return self.prep.echo is not None and self.streamed_logprobs is not None

    def echo_chunk(self, scores) -> dict:
        """The echoed prompt with its logprobs (``LaneEvent.prompt_logprobs`` of the scoring lane)."""
        part = self.streamed_logprobs.prompt(self.prep.request.prompt_tokens, scores)
        return self.shape.chunk(text=self.prep.echo, index=self.index, logprobs=part)

    def whole(self, prompt_scores=()) -> dict:
        """This choice's entry of a reply sent whole; ``prompt_scores``: the scored prompt's
        logprobs (positions 1..), for echo with logprobs."""
        top, logprobs = self.prep.logprobs, None
        if self.shape.kind == "chat":
            if top is not None:
                logprobs = chat_object(chat_entries(self.logprobs, self.text, top))
            return self.shape.choice(self.reply, self.event, self.parsed, index=self.index, logprobs=logprobs,
                                     reasoning=self.reasoning or None)
        if top is not None:
            built = CompletionLogprobs(self.text, top)
            if self.prep.echo is not None:
                built.prompt(self.prep.request.prompt_tokens, prompt_scores)
            built.add(self.logprobs)
            logprobs = built.whole
        return self.shape.choice((self.prep.echo or "") + self.reply, self.event, index=self.index,
                                 logprobs=logprobs)
