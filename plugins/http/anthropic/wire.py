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

**Usage.** Anthropic splits the prompt three ways: ``input_tokens`` (computed and not kept),
``cache_read_input_tokens`` (served from the prompt cache) and ``cache_creation_input_tokens``
(computed and written to it, for later requests to read). Superfluid's prefix cache has no
separate write: a lane that finishes leaves its KV in its slot as a cached prefix, on an engine
that keeps prefixes (``EngineCapabilities.prefix_cache``). So ``cache_read_input_tokens`` is what
the prefix cache (pool or host tier) served, ``cache_creation_input_tokens`` the rest of the prompt,
prefilled now and kept for reuse (0 on an engine without a prefix cache, or for a prompt shorter
than the shortest prefix ever reused, ``MIN_REUSE``), and ``input_tokens`` what is left (the whole
uncached prompt there, else 0); the three sum to the prompt. A stream's ``message_start`` is sent
before the lane is admitted, when the split is not known: it counts the prompt as
``input_tokens`` with both cache fields null, and ``message_delta`` carries the split.

**Stop reasons.** ``max_tokens`` is a ceiling cut to what the context leaves (the route runs with
``limit_is_ceiling``): a reply cut short of the asked ``max_tokens`` because prompt and reply
filled the context window stops with ``model_context_window_exceeded`` (Anthropic's reason for
it), one that reached ``max_tokens`` (or the key's cap) with ``max_tokens``."""

from __future__ import annotations

import json
import uuid

from aiohttp import web

from superfluid.core.errors import InvalidRequest
from superfluid.core.prefix import MIN_REUSE

from ..openai.replies import error_body, status_of
from ..wire import Wire

_STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use", "cancelled": "end_turn"}
CONTEXT_EXCEEDED = "model_context_window_exceeded"  # cut by the context window, not by max_tokens
# every stop_reason a reply can carry; /openapi.json lists these, so a client's validator accepts each
STOP_REASONS = (*dict.fromkeys(_STOP_REASONS.values()), "stop_sequence", CONTEXT_EXCEEDED)
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


def usage(prompt_tokens: int, cached: int, output_tokens: int, keeps_prefixes: bool = False) -> dict:
    """Anthropic's usage (see the module's words): ``keeps_prefixes``: the engine keeps a finished
    lane's KV as a cached prefix, so the prompt's uncached rest is written to the cache."""
    cached = min(max(cached, 0), prompt_tokens)
    created = prompt_tokens - cached if keeps_prefixes and prompt_tokens >= MIN_REUSE else 0
    return {"input_tokens": prompt_tokens - cached - created, "cache_creation_input_tokens": created,
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

    def __init__(self, model: str, max_tokens: int | None = None):
        super().__init__()
        self.model = model
        self.max_tokens = max_tokens  # what the client asked for (a ceiling)
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

    def _stop(self, finish: str | None, stop_string: str | None, prompt: int = 0,
              output: int = 0) -> tuple[str, str | None]:
        if finish == "stop" and stop_string is not None:
            return "stop_sequence", stop_string
        if finish == "length" and self.prep is not None and self.max_tokens is not None and output < self.max_tokens \
                and prompt + output >= self.prep.runtime.loop.settings.context_length:
            return CONTEXT_EXCEEDED, None
        return _STOP_REASONS.get(finish or "stop", "end_turn"), None

    def _usage(self, u: dict) -> dict:
        """The chat usage ``u`` in Anthropic's words."""
        caps = getattr(self.prep.runtime.engine, "capabilities", None) if self.prep is not None else None
        return usage(u.get("prompt_tokens", 0), (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
                     u.get("completion_tokens", 0), keeps_prefixes=bool(getattr(caps, "prefix_cache", False)))

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
        u = body["usage"]
        stop_reason, stop_sequence = self._stop(choice["finish_reason"], choice.get("stop_reason"),
                                                u["prompt_tokens"], u["completion_tokens"])
        return web.json_response({
            "id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": content,
            "stop_reason": stop_reason, "stop_sequence": stop_sequence, "usage": self._usage(u)})

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
                   "stop_reason": None, "stop_sequence": None,
                   "usage": {"input_tokens": n, "cache_creation_input_tokens": None, "cache_read_input_tokens": None,
                             "output_tokens": 0}}  # the split is not known before admission
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
        stop_reason, stop_sequence = self._stop(self.finish, self.stop_string, u.get("prompt_tokens", 0),
                                                u.get("completion_tokens", 0))
        out.append(self._event("message_delta", {
            "type": "message_delta", "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
            "usage": self._usage(u)}))
        out.append(self._event("message_stop", {"type": "message_stop"}))
        return out

    def stream_error(self, exc: BaseException | None) -> list[bytes]:
        return [self._event("error", anthropic_error(status_of(exc), error_body(exc)))]

    def ping(self) -> bytes:
        return self._event("ping", {"type": "ping"})
