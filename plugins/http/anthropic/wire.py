"""A generation answered in Anthropic's Messages format: the :class:`~..wire.Wire` the OpenAI
routes' generation run writes through, and Anthropic's error shape.

The run builds OpenAI chat objects (the whole ``chat.completion``, or chunks: the role, text
deltas, the parsed tool calls whole, the finish, then the usage chunk that
:attr:`AnthropicWire.always_usage` asks for). This wire translates them:

- whole: one ``message`` object: ``content`` blocks (a reasoning model's ``thinking``, with an
  empty ``signature``; ``text``; then ``tool_use`` with the call's id and its arguments parsed
  back into ``input``), ``stop_reason`` and ``usage``;
- streamed: ``event: NAME`` / ``data: {...}``: ``message_start``; per block
  ``content_block_start``, ``content_block_delta`` (``text_delta``, ``input_json_delta`` with the
  arguments as they are read (a call's block opens once its name is known), ``thinking_delta`` for a chunk
  carrying ``reasoning_content``), ``content_block_stop``; then ``message_delta`` (stop reason,
  usage) and ``message_stop``. ``ping`` every few seconds while nothing else is sent (a long
  prefill); a failure midway ends with an ``error`` event.

**Usage.** Anthropic splits the prompt three ways: ``input_tokens`` (computed for this request),
``cache_read_input_tokens`` (served from the prompt cache) and ``cache_creation_input_tokens``
(written to it). Superfluid's prefix cache keeps every prompt without a separate write, so
``cache_read_input_tokens`` is what the prefix cache served, ``input_tokens`` the rest, and
``cache_creation_input_tokens`` is 0; the three sum to the prompt."""

from __future__ import annotations

import json
import uuid

from aiohttp import web

from superfluid.core.errors import InvalidRequest

from ..openai.replies import error_body, status_of
from ..wire import Wire

_STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use", "cancelled": "end_turn"}
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 405: "invalid_request_error", 408: "timeout_error", 409: "invalid_request_error",
                413: "request_too_large", 415: "invalid_request_error", 422: "invalid_request_error",
                429: "rate_limit_error", 503: "overloaded_error", 529: "overloaded_error"}


def error_type(status: int) -> str:
    return _ERROR_TYPES.get(status, "api_error")


def anthropic_error(status: int, body: dict) -> dict:
    """An OpenAI-style error body as Anthropic's (an :data:`~..errors.ErrorShape`): the message
    kept, the field it names added in words when the message does not say it."""
    error = body.get("error") or {}
    message = str(error.get("message") or "error")
    param = error.get("param")
    if param and param not in message:
        message = f"{param}: {message}"
    return {"type": "error", "error": {"type": error_type(status), "message": message}}


def new_message_id() -> str:
    return "msg_" + uuid.uuid4().hex[:24]


def usage(prompt_tokens: int, cached: int, output_tokens: int) -> dict:
    return {"input_tokens": max(0, prompt_tokens - cached), "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached, "output_tokens": output_tokens}


def _input(arguments: str) -> dict:
    try:
        value = json.loads(arguments or "{}")
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


class AnthropicWire(Wire):
    """One message's answer. ``model``: the name the client asked for (echoed, as Anthropic does)."""

    always_usage = True  # message_delta carries usage
    ping_every = 5.0

    def __init__(self, model: str):
        super().__init__()
        self.model = model
        self.id = new_message_id()
        self.index = -1  # the open content block's index (-1: none yet)
        self.open: str | None = None  # its kind: "text" | "thinking" | None (closed)
        self.finish: str | None = None
        self.stop_string: str | None = None

    def prepared(self, prep) -> None:
        """A prompt that leaves no room for a reply is refused before it runs, in the words Claude
        Code answers by compacting its conversation."""
        super().prepared(prep)
        n, ctx = len(prep.request.prompt_tokens), prep.runtime.loop.settings.context_length
        if n >= ctx:
            # no param: Anthropic's message is the whole text, which clients match on
            raise InvalidRequest(f"prompt is too long: {n} tokens > {ctx - 1} maximum", code="context_length_exceeded")

    def _stop(self, finish: str | None, stop_string: str | None) -> tuple[str, str | None]:
        if finish == "stop" and stop_string is not None:
            return "stop_sequence", stop_string
        return _STOP_REASONS.get(finish or "stop", "end_turn"), None

    # ---- a reply sent whole -----------------------------------------------------------------

    def whole(self, body: dict) -> web.StreamResponse:
        choice = body["choices"][0]
        message = choice["message"]
        content = []
        if message.get("reasoning_content"):  # a reasoning model's: a thinking block first
            content.append({"type": "thinking", "thinking": message["reasoning_content"], "signature": ""})
        if message.get("content"):
            content.append({"type": "text", "text": message["content"]})
        for call in message.get("tool_calls") or ():
            content.append({"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
                            "input": _input(call["function"]["arguments"])})
        stop_reason, stop_sequence = self._stop(choice["finish_reason"], choice.get("stop_reason"))
        u = body["usage"]
        return web.json_response({
            "id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": content,
            "stop_reason": stop_reason, "stop_sequence": stop_sequence,
            "usage": usage(u["prompt_tokens"], (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
                           u["completion_tokens"])})

    def error(self, exc: BaseException | None) -> web.StreamResponse:
        status = status_of(exc)
        return web.json_response(anthropic_error(status, error_body(exc)), status=status)

    # ---- a stream ---------------------------------------------------------------------------

    @staticmethod
    def _event(name: str, data: dict) -> bytes:
        return f"event: {name}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n".encode()

    def opening(self) -> list[bytes]:
        n = len(self.prep.request.prompt_tokens) if self.prep is not None else 0
        message = {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": [],
                   "stop_reason": None, "stop_sequence": None, "usage": usage(n, 0, 0)}
        return [self._event("message_start", {"type": "message_start", "message": message})]

    def _start(self, block: dict) -> list[bytes]:
        out = self._close()
        self.index += 1
        self.open = block["type"]
        return out + [self._event("content_block_start", {"type": "content_block_start", "index": self.index,
                                                          "content_block": block})]

    def _close(self) -> list[bytes]:
        if self.open is None:
            return []
        self.open = None
        return [self._event("content_block_stop", {"type": "content_block_stop", "index": self.index})]

    def _delta(self, delta: dict) -> bytes:
        return self._event("content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta})

    def chunk(self, chunk: dict) -> list[bytes]:
        out: list[bytes] = []
        for choice in chunk.get("choices") or ():  # one: the Messages API has no n
            delta = choice.get("delta") or {}
            if delta.get("reasoning_content"):
                if self.open != "thinking":
                    out += self._start({"type": "thinking", "thinking": "", "signature": ""})
                out.append(self._delta({"type": "thinking_delta", "thinking": delta["reasoning_content"]}))
            if delta.get("content"):
                if self.open != "text":
                    out += self._start({"type": "text", "text": ""})
                out.append(self._delta({"type": "text_delta", "text": delta["content"]}))
            for call in delta.get("tool_calls") or ():
                function = call.get("function") or {}
                if function.get("name") is not None:  # a call's first piece opens its block
                    out += self._start({"type": "tool_use", "id": call.get("id"), "name": function["name"],
                                        "input": {}})
                if function.get("arguments"):  # then its arguments, as they are read
                    out.append(self._delta({"type": "input_json_delta", "partial_json": function["arguments"]}))
            if choice.get("finish_reason") is not None:
                self.finish = choice["finish_reason"]
                self.stop_string = choice.get("stop_reason")
        return out

    def closing(self, usage_chunk: dict | None) -> list[bytes]:
        out = self._close()
        u = (usage_chunk or {}).get("usage") or {}
        stop_reason, stop_sequence = self._stop(self.finish, self.stop_string)
        prompt = u.get("prompt_tokens", 0)
        cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        out.append(self._event("message_delta", {
            "type": "message_delta", "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
            "usage": usage(prompt, cached, u.get("completion_tokens", 0))}))
        out.append(self._event("message_stop", {"type": "message_stop"}))
        return out

    def stream_error(self, exc: BaseException | None) -> list[bytes]:
        return [self._event("error", anthropic_error(status_of(exc), error_body(exc)))]

    def ping(self) -> bytes:
        return self._event("ping", {"type": "ping"})
