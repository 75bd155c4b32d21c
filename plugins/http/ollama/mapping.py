"""Ollama requests as the chat and completion requests the OpenAI front end runs: a chat's
conversation (:class:`~superfluid.core.formats.conversation.Conversation`) is mapped here, its
generation fields are chat's.

- ``/api/chat``: ``messages`` → the conversation's messages. ``images`` (base64) → image parts
  before the text; an assistant's ``tool_calls`` (arguments an object) → its calls, each given
  an id; a ``tool`` message → the result of the earliest unanswered call of its ``tool_name``
  (Ollama names the tool, not the call); ``thinking`` → the assistant's reasoning (given to a
  template that renders it, as Qwen3's does).
- ``/api/generate``: ``raw`` → a completion of the prompt as given; ``suffix`` → fill in the
  middle; otherwise the prompt is the user message of a chat (``system`` before it), as Ollama
  renders it through the model's template.
- ``options`` → sampling (see :data:`.protocol.OPTION_RULES`); ``num_predict`` → ``max_tokens``,
  run as a ceiling (Ollama stops at the context's end rather than refusing);
- ``format``: ``"json"`` → ``response_format`` ``json_object``; a schema → ``json_schema``;
- ``tools`` → chat's ``tools`` (Ollama's are OpenAI's function tools)."""

from __future__ import annotations

from superfluid.core.errors import InvalidRequest
from superfluid.core.formats.conversation import Conversation, ImageRef, Message, ToolCall, parts_of

from ..content import ImagePart
from ..openai.chat_protocol import MappedChat
from ..openai.protocol import CompletionRequest
from ..typed import parse
from .protocol import OllamaChatRequest, OllamaGenerateRequest, OllamaMessage, OllamaOptions

UNBOUNDED = 1 << 30
_SAMPLING = ("temperature", "top_p", "top_k", "min_p", "seed", "repeat_penalty", "presence_penalty",
             "frequency_penalty")


def _parts(text: str, images: list[str] | None, where: str) -> tuple:
    """A message's text, after its images (``where``: the field that holds them)."""
    refs = tuple(ImageRef(ImagePart(type="image_url", image_url=_url(data)), f"{where}[{j}]")
                 for j, data in enumerate(images or ()))
    return (*refs, *parts_of(text))


def _url(data: str) -> str:
    return data if data.startswith("data:") else "data:image/png;base64," + data  # the format is read from the bytes


def chat_messages(messages: list[OllamaMessage]) -> list[Message]:
    """``messages`` as the conversation's messages."""
    out: list[Message] = []
    unanswered: list[tuple[str, str]] = []  # (call id, tool name), oldest first
    for i, m in enumerate(messages):
        thought = m.thinking or None if m.role == "assistant" else None
        if m.role == "assistant" and m.tool_calls:
            calls = tuple(ToolCall.of(f"call_{i}_{j}", call.function.name, call.function.arguments)
                          for j, call in enumerate(m.tool_calls))
            unanswered += [(call.id, call.name) for call in calls]
            out.append(Message.plain("assistant", m.content, tool_calls=calls, reasoning=thought))
        elif m.role == "tool":
            match = next((k for k, (_, name) in enumerate(unanswered) if m.tool_name in (None, name)), None)
            call_id = unanswered.pop(match)[0] if match is not None else f"call_{i}"
            out.append(Message.plain("tool", m.content, tool_call_id=call_id))
        else:
            out.append(Message(m.role, _parts(m.content, m.images, f"messages[{i}].images"), reasoning=thought))
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


def chat_request(req: OllamaChatRequest, model: str, stream: bool) -> MappedChat:
    body = _chat_fields(req, {"model": model, **_generation(req, req.options, stream)}, stream)
    if req.tools:
        body["tools"] = req.tools  # Ollama's tools are chat's function tools, checked by chat's rules
    if req.logprobs:
        body["logprobs"] = True
        if req.top_logprobs is not None:
            body["top_logprobs"] = req.top_logprobs
    return MappedChat.of(Conversation(chat_messages(req.messages)), body)


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
    messages = [Message.plain("system", req.system)] if req.system else []
    messages.append(Message("user", _parts(req.prompt or "", req.images, "images")))
    return MappedChat.of(Conversation(messages), _chat_fields(req, {"model": model, **common}, stream))
