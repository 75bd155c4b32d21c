"""Response bodies for one generation: an OpenAI chat or text completion, or a llama.cpp-style
infill, whole or as SSE chunks, and the errors a generation can end with.

Kept apart from the routes so the wire format (what clients parse) lives in one place and is
testable without a server."""

from __future__ import annotations

import json
import time
import uuid

from aiohttp import web

from superfluid.core.errors import SuperfluidError

from ..errors import error_response, from_exception
from ..prepare.reply_read import Parsed

DONE = b"data: [DONE]\n\n"  # the end of an OpenAI stream (infill streams end without it)


def sse(obj: dict) -> bytes:
    """One server-sent event holding ``obj`` as JSON (non-ASCII written as is)."""
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


def server_timings(event) -> dict:
    """The server's own view of a request, in llama.cpp server's names plus queue and TTFT:
    what a client needs to tell queueing, prefill and decode apart."""
    t = event.timings or {}

    def ms(start: str, end: str) -> float | None:
        if t.get(start) is None or t.get(end) is None:
            return None
        return round((t[end] - t[start]) * 1000, 3)

    return {"queued_ms": ms("arrived", "admitted_at"), "ttft_ms": ms("arrived", "first_token_at"),
            "prompt_n": t.get("prefilled", 0), "prompt_ms": ms("admitted_at", "first_token_at"),
            "predicted_n": event.completion_tokens, "predicted_ms": ms("first_token_at", "finished_at")}


def status_of(exc: BaseException | None) -> int:
    return exc.status if isinstance(exc, SuperfluidError) else 500


def error_body(exc: BaseException | None) -> dict:
    """A failure as the error object an SSE stream ends with."""
    if isinstance(exc, SuperfluidError):
        return exc.to_body()
    return {"error": {"message": str(exc), "type": "server_error", "param": None, "code": None}}


def error_reply(exc: BaseException | None) -> web.Response:
    """A failure as the response of a reply sent whole."""
    if isinstance(exc, SuperfluidError):
        return from_exception(exc)
    return error_response(500, f"generation failed: {exc}")


def _usage(events, reasoning_tokens: int | None = None) -> dict:
    """``usage`` of one lane's final event, or of several (the choices of one reply, which share
    their prompt): the prompt counted once, completion tokens summed; ``reasoning_tokens`` (a
    reasoning model's: those of its reasoning span, part of the completion tokens) adds
    ``completion_tokens_details``."""
    events = events if isinstance(events, (list, tuple)) else [events]
    first, completion = events[0], sum(e.completion_tokens for e in events)
    out = {"prompt_tokens": first.prompt_tokens, "completion_tokens": completion,
           "total_tokens": first.prompt_tokens + completion,
           "prompt_tokens_details": {"cached_tokens": first.cached_tokens}}
    if reasoning_tokens is not None:
        out["completion_tokens_details"] = {"reasoning_tokens": min(reasoning_tokens, completion)}
    return out


class Shape:
    """Builds the response objects of one request: one id and creation time for all of them.
    ``index`` is a choice's (``n`` > 1); ``logprobs`` its shaped logprobs (:mod:`..prepare.logprob_format`)."""

    def __init__(self, kind: str, model: str):
        self.kind = kind  # "chat" | "completion" | "infill"
        self.model = model
        self.created = int(time.time())
        self.id = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]

    def _object(self, chunk: bool) -> str:
        if self.kind == "chat":
            return "chat.completion.chunk" if chunk else "chat.completion"
        return "text_completion"

    def _envelope(self, choices: list, chunk: bool) -> dict:
        return {"id": self.id, "object": self._object(chunk), "created": self.created, "model": self.model,
                "choices": choices}

    def choice(self, text: str, event, parsed: Parsed | None = None, *, index: int = 0,
               logprobs: dict | None = None, reasoning: str | None = None) -> dict:
        """One choice of a reply sent whole; ``parsed``: the reply split into content and calls
        (tools were offered). ``stop_reason`` is the stop string that ended it, or null (vLLM's
        field; Anthropic's ``stop_sequence`` is read from it)."""
        if self.kind == "chat":
            message = {"role": "assistant", "content": text}
            if reasoning:  # a reasoning model's (the wire may rename it: --reasoning-field)
                message["reasoning_content"] = reasoning
            finish = event.finish_reason
            if parsed is not None:
                message["content"], finish = parsed.content, parsed.finish_reason
                if parsed.calls:
                    message["tool_calls"] = parsed.calls
            return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish,
                    "stop_reason": event.stop_string}
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": event.finish_reason,
                "stop_reason": event.stop_string}

    def whole(self, text: str, event, parsed: Parsed | None = None, *, logprobs: dict | None = None) -> dict:
        """The body of a one-choice reply sent whole."""
        if self.kind == "infill":
            return {"content": text, "model": self.model, "stop": True,
                    "finish_reason": event.finish_reason, "tokens_predicted": event.completion_tokens,
                    "tokens_evaluated": event.prompt_tokens, "usage": _usage(event)}
        return self.replies([self.choice(text, event, parsed, logprobs=logprobs)], [event])

    def replies(self, choices: list[dict], events: list, reasoning_tokens: int | None = None) -> dict:
        """The body of a reply sent whole with these choices (index order) and their lanes' final
        events; ``timings`` are the first choice's, its ``predicted_n`` all of theirs."""
        timings = server_timings(events[0])
        if len(events) > 1:
            timings["predicted_n"] = sum(e.completion_tokens for e in events)
        return {**self._envelope(choices, chunk=False), "usage": _usage(events, reasoning_tokens),
                "timings": timings}

    def chunk(self, text: str = "", finish: str | None = None, role: bool = False, event=None,
              tool_calls: list | None = None, *, index: int = 0, logprobs: dict | None = None,
              reasoning: str = "") -> dict:
        """One streamed chunk of choice ``index``: the opening role (chat), text, the calls, or
        the finish."""
        if self.kind == "infill":
            out = {"content": text, "stop": finish is not None}
            if event is not None:
                out.update(finish_reason=finish, tokens_predicted=event.completion_tokens,
                           tokens_evaluated=event.prompt_tokens)
            return out
        if self.kind == "chat":
            delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
            if reasoning:
                delta["reasoning_content"] = reasoning
            if tool_calls:
                delta["tool_calls"] = tool_calls
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        else:
            choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}
        if finish is not None and event is not None:
            choice["stop_reason"] = event.stop_string  # the stop string that ended it (vLLM's field)
        return self._envelope([choice], chunk=True)

    def usage_chunk(self, events, reasoning_tokens: int | None = None) -> dict:
        """The last chunk of a stream with ``stream_options.include_usage`` (``events``: the final
        event of each choice, or the one)."""
        events = events if isinstance(events, (list, tuple)) else [events]
        body = self.replies([], events, reasoning_tokens)
        return {**self._envelope([], chunk=True), "usage": body["usage"], "timings": body["timings"]}
