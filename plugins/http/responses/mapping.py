"""A typed Responses request as the chat request the OpenAI front end runs.

- ``instructions`` → a system message first (per request: OpenAI does not carry them over with
  ``previous_response_id``);
- items → messages: a message item is a message of its role (``developer`` is rendered as
  ``system``, as in chat); ``function_call`` items join the assistant message right before them
  as its ``tool_calls`` (or open one with no content), so a reply sent back as a message item
  and its call items renders exactly as the reply the model gave, and the prefix cache serves
  it; ``function_call_output`` → a ``tool`` message; ``reasoning`` items are dropped;
- ``text.format`` → ``response_format`` (``json_object`` and ``json_schema`` are enforced by the
  same constraint); ``max_output_tokens`` → ``max_tokens``; function tools → chat tools, every
  other type left out; ``tool_choice`` → chat's (``allowed_tools`` offers only the tools it
  lists, with its mode as the choice).

The chat request is validated as any chat request is; the Responses rules above it
(:mod:`.protocol`) keep every input the mapping takes valid there."""

from __future__ import annotations

from superfluid.core.errors import InvalidRequest

from ..openai.chat_protocol import ChatCompletionRequest
from ..typed import parse
from .protocol import (ResponsesAllowedTools, ResponsesFunctionCallItem, ResponsesFunctionCallOutputItem,
                       ResponsesFunctionChoice, ResponsesFunctionTool, ResponsesInput, ResponsesJsonSchemaFormat,
                       ResponsesMessageItem, ResponsesRequest, chat_content, content_text)


def instructions(req: ResponsesInput) -> list[dict]:
    """The system message ``instructions`` stands for (none without them)."""
    return [{"role": "system", "content": req.instructions}] if req.instructions else []


def input_messages(req: ResponsesInput) -> list[dict]:
    """The request's input as chat messages (the JSON chat's ``messages`` takes)."""
    if req.input is None:
        return []
    if isinstance(req.input, str):
        return [{"role": "user", "content": req.input}]
    out: list[dict] = []
    for item in req.input:
        if isinstance(item, ResponsesMessageItem):
            out.append({"role": item.role, "content": chat_content(item.content)})
        elif isinstance(item, ResponsesFunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif isinstance(item, ResponsesFunctionCallOutputItem):
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": content_text(item.output)})
        # reasoning items: dropped
    return out


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


def chat_request(req: ResponsesInput, history: list[dict] = (), new: list[dict] | None = None) -> ChatCompletionRequest:
    """The chat request a response runs: its instructions, then ``history`` (a stored
    conversation's messages), then its new messages (``new``, default: its input's)."""
    new = input_messages(req) if new is None else new
    messages = instructions(req) + list(history) + new
    if not messages:
        raise InvalidRequest("input is required: there is nothing to respond to (send input, instructions or "
                             "previous_response_id)", param="input", code="missing_required_parameter")
    return parse(ChatCompletionRequest, {**chat_fields(req), "messages": messages})
