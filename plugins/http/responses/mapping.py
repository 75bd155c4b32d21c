"""A typed Responses request as the chat the OpenAI front end runs: its conversation
(:class:`~superfluid.core.formats.conversation.Conversation`, mapped here item by item) and
chat's generation fields.

- ``instructions`` → a system message first (per request: OpenAI does not carry them over with
  ``previous_response_id``);
- items → messages: a message item is a message of its role (``developer`` is rendered as
  ``system``, as in chat); ``function_call`` items join the assistant message right before them
  as its tool calls (or open one with no content), so a reply sent back as a message item
  and its call items renders exactly as the reply the model gave, and the prefix cache serves
  it; ``function_call_output`` → a ``tool`` message; ``reasoning`` items are dropped;
- a stored conversation (``previous_response_id``) keeps its turns in its session's log in
  chat's message shape (what ``GET /v1/sessions/{id}`` shows): :func:`stored` writes the new
  messages so;
- ``text.format`` → ``response_format`` (``json_object`` and ``json_schema`` are enforced by the
  same constraint); ``max_output_tokens`` → ``max_tokens``; function tools → chat tools, every
  other type left out; ``tool_choice`` → chat's (``allowed_tools`` offers only the tools it
  lists, with its mode as the choice).

The generation fields are validated as any chat request's are; the Responses rules above them
(:mod:`.protocol`) keep every input the mapping takes valid there."""

from __future__ import annotations

import attrs

from superfluid.core.errors import InvalidRequest
from superfluid.core.formats.conversation import Conversation, ImageRef, Message, TextPart, ToolCall, parts_of

from ..content import ImagePart, ImageUrl
from ..openai.chat_protocol import MappedChat, kept_messages
from .protocol import (ResponsesAllowedTools, ResponsesFunctionCallItem, ResponsesFunctionCallOutputItem,
                       ResponsesFunctionChoice, ResponsesFunctionTool, ResponsesImagePart, ResponsesInput,
                       ResponsesJsonSchemaFormat, ResponsesMessageItem, ResponsesRequest, ResponsesTextPart,
                       content_text)


def instructions(req: ResponsesInput) -> list[Message]:
    """The system message ``instructions`` stands for (none without them)."""
    return [Message.plain("system", req.instructions)] if req.instructions else []


def _parts(content, where: str) -> tuple:
    """A message item's content as parts, images where they were."""
    if isinstance(content, str):
        return parts_of(content)
    out = []
    for j, p in enumerate(content):
        if isinstance(p, ResponsesImagePart):
            url = ImageUrl(url=p.image_url, detail=p.detail or "auto")
            out.append(ImageRef(ImagePart(type="image_url", image_url=url), f"{where}[{j}].image_url"))
        else:
            out.append(TextPart(p.text if isinstance(p, ResponsesTextPart) else p.refusal))
    return tuple(out)


def input_messages(req: ResponsesInput) -> list[Message]:
    """The request's input as the conversation's messages."""
    if req.input is None:
        return []
    if isinstance(req.input, str):
        return [Message.plain("user", req.input)]
    out: list[Message] = []
    for i, item in enumerate(req.input):
        if isinstance(item, ResponsesMessageItem):
            out.append(Message(item.role, _parts(item.content, f"input[{i}].content")))
        elif isinstance(item, ResponsesFunctionCallItem):
            call = ToolCall.of(item.call_id, item.name, item.arguments)
            if out and out[-1].role == "assistant":
                out[-1] = attrs.evolve(out[-1], tool_calls=(*out[-1].tool_calls, call))
            else:
                out.append(Message("assistant", tool_calls=(call,)))
        elif isinstance(item, ResponsesFunctionCallOutputItem):
            out.append(Message.plain("tool", content_text(item.output), tool_call_id=item.call_id))
        # reasoning items: dropped
    return out


def stored(messages: list[Message]) -> list[dict]:
    """New messages as the session's log keeps them: chat's message shape."""
    out = []
    for m in messages:
        msg: dict = {"role": m.role, "content": _stored_content(m)}
        if m.tool_calls:
            msg["tool_calls"] = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.text}}
                                 for c in m.tool_calls]
        if m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        out.append(msg)
    return out


def _stored_content(m: Message) -> str | list[dict] | None:
    if not m.images:
        return m.text if m.has_content or not m.tool_calls else None
    return [p.ref.model_dump(exclude_none=True) if isinstance(p, ImageRef) else {"type": "text", "text": p.text}
            for p in m.parts]


def _offered(req: ResponsesInput) -> list[ResponsesFunctionTool]:
    functions = [t for t in req.tools or () if isinstance(t, ResponsesFunctionTool)]
    if isinstance(req.tool_choice, ResponsesAllowedTools):
        allowed = {t.name for t in req.tool_choice.tools if t.type == "function"}
        functions = [t for t in functions if t.name in allowed]
    return functions


def _tool_choice(req: ResponsesInput):
    choice = req.tool_choice
    if isinstance(choice, ResponsesFunctionChoice):
        return {"type": "function", "function": {"name": choice.name}}
    if isinstance(choice, ResponsesAllowedTools):
        return choice.mode
    return choice


def _response_format(req: ResponsesInput) -> dict | None:
    fmt = req.text.format if req.text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if isinstance(fmt, ResponsesJsonSchemaFormat):
        spec = {"name": fmt.name, "schema": fmt.schema_}
        if fmt.description is not None:
            spec["description"] = fmt.description
        if fmt.strict is not None:
            spec["strict"] = fmt.strict
        return {"type": "json_schema", "json_schema": spec}
    return {"type": "json_object"}


def chat_fields(req: ResponsesInput) -> dict:
    """Every chat field but the messages."""
    out: dict = {"parallel_tool_calls": req.parallel_tool_calls}
    if req.model is not None:
        out["model"] = req.model
    tools = _offered(req)
    if tools:
        out["tools"] = [{"type": "function", "function": t.model_dump(include={"name", "description", "parameters"},
                                                                       exclude_none=True)} for t in tools]
        if req.tool_choice is not None:
            out["tool_choice"] = _tool_choice(req)
    response_format = _response_format(req)
    if response_format is not None:
        out["response_format"] = response_format
    if req.reasoning is not None and req.reasoning.effort is not None:
        out["reasoning_effort"] = req.reasoning.effort  # "none"/"minimal": enable_thinking false
    if req.grammar is not None:
        out["grammar"] = req.grammar
    if isinstance(req, ResponsesRequest):
        out.update(stream=req.stream, temperature=req.temperature, top_p=req.top_p)
        if req.max_output_tokens is not None:
            out["max_tokens"] = req.max_output_tokens
        if req.superfluid is not None:
            out["superfluid"] = req.superfluid.model_dump(exclude_none=True)
    return out


def chat_request(req: ResponsesInput, history: list[dict] = (), new: list[Message] | None = None) -> MappedChat:
    """The chat a response runs: its instructions, then ``history`` (a stored conversation's
    messages, as its session keeps them), then its new messages (``new``, default: its input's)."""
    new = input_messages(req) if new is None else new
    messages = instructions(req) + kept_messages(list(history)) + list(new)
    if not messages:
        raise InvalidRequest("input is required: there is nothing to respond to (send input, instructions or "
                             "previous_response_id)", param="input", code="missing_required_parameter")
    return MappedChat.of(Conversation(messages), chat_fields(req))
