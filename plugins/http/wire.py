"""How one generation is answered on the wire: the seam between the generation run, which every
generating front end shares, and the bytes a client parses.

:class:`~.openai.routes.OpenAIRoutes` runs a prepared request's lanes and builds OpenAI's chat
objects from their events: the whole ``chat.completion``, or ``chat.completion.chunk`` objects
as they come. A :class:`Wire` turns those into the API the request came in on. OpenAI's is
this base class, unchanged; the Anthropic Messages and OpenAI Responses front ends subclass it
and translate each chunk into their own events. Translating the finished objects, rather than
shaping each API from the lanes' events, keeps one place that decides what a reply holds (the
text as released, the parsed tool calls, the finish reason, usage with cached tokens), so the
APIs cannot disagree about a reply."""

from __future__ import annotations

from aiohttp import web

from .openai.replies import DONE, error_body, error_reply, sse


class Wire:
    """One generation's answer, in OpenAI's format. A subclass overrides what its API changes.

    ``always_usage``: the stream needs the usage chunk at its end whether or not the client asked
    for it (``stream_options.include_usage``), because the API's closing event carries usage.
    ``ping_every``: seconds without an event after which :meth:`ping` is written (None: never),
    so a client and the proxies between keep a stream open through a long prefill.
    ``content_type``: what a stream is (server-sent events, or Ollama's NDJSON lines)."""

    always_usage = False
    ping_every: float | None = None
    content_type = "text/event-stream"  # a stream's media type (Ollama's: NDJSON)

    def __init__(self, reasoning_field: str = "reasoning_content"):
        self.prep = None  # the Prepared request, once prepared
        self.reasoning_field = reasoning_field  # OpenAI's name for a reasoning model's reasoning

    def _renamed(self, body: dict) -> dict:
        """``body`` with ``reasoning_content`` (message, delta) named :attr:`reasoning_field`."""
        if self.reasoning_field == "reasoning_content":
            return body
        for choice in body.get("choices") or ():
            for key in ("message", "delta"):
                part = choice.get(key)
                if part and "reasoning_content" in part:
                    part[self.reasoning_field] = part.pop("reasoning_content")
        return body

    def prepared(self, prep) -> None:
        """The request is prepared (its prompt tokenized, its model chosen), not yet queued: a
        last check of this API's own rules (raise a SuperfluidError to refuse it)."""
        self.prep = prep

    # ---- a reply sent whole -----------------------------------------------------------------

    def whole(self, body: dict) -> web.StreamResponse:
        """The response for the complete ``chat.completion`` (or text completion) ``body``."""
        return web.json_response(self._renamed(body))

    def error(self, exc: BaseException | None) -> web.StreamResponse:
        """The response of a generation that failed before its reply was sent."""
        return error_reply(exc)

    # ---- a stream ---------------------------------------------------------------------------

    def opening(self) -> list[bytes]:
        """What a stream starts with, before any chunk."""
        return []

    def chunk(self, chunk: dict) -> list[bytes]:
        """The bytes for one chunk object (a choice's role, text, tool calls or finish)."""
        return [sse(self._renamed(chunk))]

    def stream_error(self, exc: BaseException | None) -> list[bytes]:
        """What a stream that failed midway ends with (OpenAI's: the error object, then [DONE])."""
        return [sse(error_body(exc)), *self._done()]

    def closing(self, usage: dict | None) -> list[bytes]:
        """What a stream that finished ends with; ``usage``: the usage chunk, when the client
        asked for it or :attr:`always_usage`."""
        return ([sse(usage)] if usage is not None else []) + self._done()

    def _done(self) -> list[bytes]:
        return [] if self.prep is not None and self.prep.kind == "infill" else [DONE]  # llama.cpp's infill has none

    def ping(self) -> bytes:
        """A keep-alive event (only written when :attr:`ping_every` is set)."""
        return b": ping\n\n"
