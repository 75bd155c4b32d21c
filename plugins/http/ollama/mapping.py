"""Ollama requests as the chat and completion requests the OpenAI front end runs.

- ``/api/chat``: ``messages`` → chat messages. ``images`` (base64) → image parts before the
  text; an assistant's ``tool_calls`` (arguments an object) → its calls, each given an id; a
  ``tool`` message → the result of the earliest unanswered call of its ``tool_name`` (Ollama
  names the tool, not the call); ``thinking`` is left out of the prompt.
- ``/api/generate``: ``raw`` → a completion of the prompt as given; ``suffix`` → fill in the
  middle; otherwise the prompt is the user message of a chat (``system`` before it), as Ollama
  renders it through the model's template.
- ``options`` → sampling (see :data:`.protocol.OPTION_RULES`); ``num_predict`` → ``max_tokens``,
  run as a ceiling (Ollama stops at the context's end rather than refusing);
- ``format``: ``"json"`` → ``response_format`` ``json_object``; a schema → ``json_schema``;
- ``tools`` → chat's ``tools`` (Ollama's are OpenAI's function tools)."""

from __future__ import annotations

import json

from superfluid.core.errors import InvalidRequest

from ..openai.chat_protocol import ChatCompletionRequest
from ..openai.protocol import CompletionRequest
from ..typed import parse
from .protocol import OllamaChatRequest, OllamaGenerateRequest, OllamaMessage, OllamaOptions

UNBOUNDED = 1 << 30
_SAMPLING = ("temperature", "top_p", "top_k", "min_p", "seed", "repeat_penalty", "presence_penalty",
             "frequency_penalty")


def _image_part(data: str) -> dict:
    url = data if data.startswith("data:") else "data:image/png;base64," + data  # the format is read from the bytes
    return {"type": "image_url", "image_url": {"url": url}}


def _content(text: str, images: list[str] | None):
    if not images:
        return text
    return [*(_image_part(i) for i in images), {"type": "text", "text": text}]


def chat_messages(messages: list[OllamaMessage]) -> list[dict]:
    out: list[dict] = []
    unanswered: list[tuple[str, str]] = []  # (call id, tool name), oldest first
    for i, m in enumerate(messages):
        if m.role == "assistant" and m.tool_calls:
            calls = []
            for j, call in enumerate(m.tool_calls):
                call_id = f"call_{i}_{j}"
                args = call.function.arguments
                calls.append({"id": call_id, "type": "function", "function": {
                    "name": call.function.name,
                    "arguments": args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)}})
                unanswered.append((call_id, call.function.name))
            out.append({"role": "assistant", "content": m.content or None, "tool_calls": calls})
        elif m.role == "tool":
            match = next((k for k, (_, name) in enumerate(unanswered) if m.tool_name in (None, name)), None)
            call_id = unanswered.pop(match)[0] if match is not None else f"call_{i}"
            out.append({"role": "tool", "tool_call_id": call_id, "content": m.content})
        else:
            out.append({"role": m.role, "content": _content(m.content, m.images)})
        if m.role == "assistant" and m.thinking:
            out[-1]["reasoning_content"] = m.thinking  # for a template that renders it (Qwen3's)
    return out


def _generation(req, options: OllamaOptions | None, stream: bool) -> dict:
    """The fields every generation shares: sampling, limits, stop, format, stream."""
    body: dict = {"stream": stream}
    o = options or OllamaOptions()
    for name in _SAMPLING:
        value = getattr(o, name)
        if value is not None:
            body[name] = value
    if o.stop is not None:
        body["stop"] = o.stop
    # -1, -2 or none: until the end of the context (a ceiling, so it is cut to what is left)
    body["max_tokens"] = o.num_predict if o.num_predict is not None and o.num_predict > 0 else UNBOUNDED
    return body


def _format(fmt) -> dict | None:
    if fmt in (None, ""):
        return None
    if fmt == "json":
        return {"type": "json_object"}
    return {"type": "json_schema", "json_schema": {"name": "format", "schema": fmt}}


def _think(req, body: dict) -> None:
    """``think`` (false; true or low/medium/high) as the chat template's ``enable_thinking``."""
    if req.think is not None:
        body["chat_template_kwargs"] = {"enable_thinking": req.think is not False}


def _chat_fields(req, body: dict, stream: bool) -> dict:
    """What a chat body gets from either route: ``think``, the usage chunk a stream ends with (the
    last line's counters), ``format``."""
    _think(req, body)
    if stream:
        body["stream_options"] = {"include_usage": True}
    fmt = _format(req.format)
    if fmt is not None:
        body["response_format"] = fmt
    return body


def chat_request(req: OllamaChatRequest, model: str, stream: bool) -> ChatCompletionRequest:
    body = _chat_fields(req, {"model": model, "messages": chat_messages(req.messages),
                              **_generation(req, req.options, stream)}, stream)
    if req.tools:
        body["tools"] = req.tools
    if req.logprobs:
        body["logprobs"] = True
        if req.top_logprobs is not None:
            body["top_logprobs"] = req.top_logprobs
    return parse(ChatCompletionRequest, body)


def generate_request(req: OllamaGenerateRequest, model: str, stream: bool):
    """A chat request (the prompt rendered by the template) or, with ``raw`` or ``suffix``, a
    completion request."""
    common = _generation(req, req.options, stream)
    if req.raw or req.suffix is not None:
        if req.images:
            raise InvalidRequest("images need the chat template: leave raw unset and send no suffix",
                                 param="images", code="unsupported_value")
        if req.format not in (None, ""):
            raise InvalidRequest("format needs the chat template: leave raw unset", param="format",
                                 code="unsupported_value")
        body = {"model": model, "prompt": req.prompt or "", **common}
        if req.suffix is not None:
            body["suffix"] = req.suffix
        return parse(CompletionRequest, body)
    messages = [{"role": "system", "content": req.system}] if req.system else []
    messages.append({"role": "user", "content": _content(req.prompt or "", req.images)})
    return parse(ChatCompletionRequest, _chat_fields(req, {"model": model, "messages": messages, **common}, stream))
