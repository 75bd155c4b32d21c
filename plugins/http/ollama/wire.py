"""A generation answered in Ollama's format: NDJSON lines (a JSON object a line), or one object
for ``stream: false``; and Ollama's error shape, ``{"error": "…"}``.

The OpenAI routes' generation run builds OpenAI objects (a chat's or a completion's, whole or
in chunks); :class:`OllamaWire` translates them:

- a line per text delta: ``/api/chat``'s ``{"model", "created_at", "message": {"role":
  "assistant", "content"}, "done": false}``, ``/api/generate``'s ``{"…", "response", "done":
  false}``; tool calls arrive whole, as a ``message.tool_calls`` line (``arguments`` an object,
  as Ollama sends them);
- the last line (or the whole reply) has ``done: true``, ``done_reason`` (``stop``, ``length``)
  and Ollama's counters: ``prompt_eval_count`` / ``eval_count`` (the prompt's and the reply's
  tokens) and ``total_duration``, ``load_duration`` (0: models stay loaded),
  ``prompt_eval_duration``, ``eval_duration`` in nanoseconds, from the server's own timings;
- a failure midway is a last line ``{"error": "…"}``, as Ollama ends a broken stream."""

from __future__ import annotations

import json
import time
from datetime import datetime, timezone

from aiohttp import web

from ..openai.replies import error_body, status_of
from ..wire import Wire

NDJSON = "application/x-ndjson"
_DONE_REASONS = {"stop": "stop", "length": "length", "tool_calls": "stop", "cancelled": "stop"}


def ollama_error(status: int, body: dict) -> dict:
    """An OpenAI-style error body as Ollama's ``{"error": "…"}`` (the field it names kept in the
    words when the message does not say it)."""
    error = body.get("error") or {}
    message = str(error.get("message") or "error")
    param = error.get("param")
    if param and param not in message:
        message = f"{param}: {message}"
    return {"error": message}


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


def line(obj: dict) -> bytes:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n"


def _arguments(text: str | dict):
    if isinstance(text, dict):
        return text
    try:
        value = json.loads(text or "{}")
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


def counters(usage: dict | None, timings: dict | None, arrived: float) -> dict:
    """Ollama's final counters from OpenAI's usage and the server's timings (ms)."""
    usage, timings = usage or {}, timings or {}
    ns = 1_000_000
    return {"total_duration": int((time.monotonic() - arrived) * 1e9), "load_duration": 0,
            "prompt_eval_count": int(usage.get("prompt_tokens", 0)),
            "prompt_eval_duration": int((timings.get("prompt_ms") or 0) * ns),
            "eval_count": int(usage.get("completion_tokens", 0)),
            "eval_duration": int((timings.get("predicted_ms") or 0) * ns)}


class OllamaWire(Wire):
    """One ``/api/chat`` (``chat=True``) or ``/api/generate`` answer. ``model``: the name the
    client asked for (echoed, as Ollama does); ``arrived``: monotonic time the request arrived."""

    always_usage = True  # the last line carries the counters
    content_type = NDJSON

    def __init__(self, model: str, chat: bool, arrived: float):
        super().__init__()
        self.model = model
        self.chat = chat
        self.arrived = arrived
        self.finish: str | None = None
        self._pending: dict[int, tuple[str, str]] = {}  # a streamed call's (name, arguments so far) by index

    def _head(self) -> dict:
        return {"model": self.model, "created_at": now_iso()}

    def _text(self, text: str) -> dict:
        if self.chat:
            return {**self._head(), "message": {"role": "assistant", "content": text}, "done": False}
        return {**self._head(), "response": text, "done": False}

    def _done(self, usage: dict | None, timings: dict | None, message: dict | None = None,
              text: str = "") -> dict:
        out = {**self._head()}
        if self.chat:
            out["message"] = message or {"role": "assistant", "content": ""}
        else:
            out["response"] = text
        out.update(done=True, done_reason=_DONE_REASONS.get(self.finish or "stop", "stop"),
                   **counters(usage, timings, self.arrived))
        return out

    # ---- whole --------------------------------------------------------------------------------

    def whole(self, body: dict) -> web.StreamResponse:
        choice = body["choices"][0]
        self.finish = choice.get("finish_reason")
        if self.chat:
            msg = choice.get("message") or {}
            message = {"role": "assistant", "content": msg.get("content") or ""}
            calls = msg.get("tool_calls")
            if calls:
                message["tool_calls"] = [self._call(c) for c in calls]
            reasoning = msg.get("reasoning_content")
            if reasoning:
                message["thinking"] = reasoning
            return web.json_response(self._done(body.get("usage"), body.get("timings"), message=message))
        # /api/generate runs a chat unless raw: its text is the message's
        text = (choice.get("message") or {}).get("content") if "message" in choice else choice.get("text")
        out = self._done(body.get("usage"), body.get("timings"), text=text or "")
        reasoning = (choice.get("message") or {}).get("reasoning_content")
        if reasoning:
            out["thinking"] = reasoning
        return web.json_response(out)

    def error(self, exc: BaseException | None) -> web.StreamResponse:
        status = status_of(exc)
        return web.json_response(ollama_error(status, error_body(exc)), status=status)

    @staticmethod
    def _call(call: dict) -> dict:
        fn = call.get("function") or {}
        return {"function": {"name": fn.get("name", ""), "arguments": _arguments(fn.get("arguments") or "{}")}}

    # ---- streamed -----------------------------------------------------------------------------

    def chunk(self, chunk: dict) -> list[bytes]:
        out = []
        for choice in chunk.get("choices") or ():
            if choice.get("finish_reason"):
                self.finish = choice["finish_reason"]
            if self.chat:
                delta = choice.get("delta") or {}
                if delta.get("reasoning_content"):
                    out.append(line({**self._head(), "message": {"role": "assistant", "content": "",
                                                                  "thinking": delta["reasoning_content"]},
                                     "done": False}))
                if delta.get("content"):
                    out.append(line(self._text(delta["content"])))
                for call in delta.get("tool_calls") or ():  # pieces of calls: kept until the reply ends
                    fn = call.get("function") or {}
                    name, args = self._pending.get(call["index"], ("", ""))
                    self._pending[call["index"]] = (fn.get("name") or name, args + (fn.get("arguments") or ""))
                if choice.get("finish_reason") and self._pending:  # Ollama sends calls whole, in one line
                    calls = [{"function": {"name": name, "arguments": args}}
                             for name, args in (self._pending[i] for i in sorted(self._pending))]
                    self._pending = {}
                    out.append(line({**self._head(), "message": {
                        "role": "assistant", "content": "", "tool_calls": [self._call(c) for c in calls]},
                        "done": False}))
            else:  # /api/generate: a completion's text, or (unless raw) a chat's content
                delta = choice.get("delta") or {}
                if delta.get("reasoning_content"):
                    out.append(line({**self._head(), "response": "", "thinking": delta["reasoning_content"],
                                     "done": False}))
                text = choice.get("text") if "text" in choice else delta.get("content")
                if text:
                    out.append(line(self._text(text)))
        return out

    def stream_error(self, exc: BaseException | None) -> list[bytes]:
        return [line(ollama_error(status_of(exc), error_body(exc)))]

    def closing(self, usage: dict | None) -> list[bytes]:
        usage = usage or {}
        return [line(self._done(usage.get("usage"), usage.get("timings")))]

    def ping(self) -> bytes:  # never written: ping_every is None
        return b""
