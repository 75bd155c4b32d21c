"""A typed Messages request as the chat request the OpenAI front end runs.

- ``system`` → a system message first (its text blocks joined by a blank line); a system
  message in ``messages`` stays where it is;
- a user message's ``tool_result`` blocks → ``tool`` messages (in order, before the user's own
  text, as chat templates expect them right after the calls); ``is_error`` puts ``Error:`` before
  the result's text;
- an assistant message's ``tool_use`` blocks → its ``tool_calls`` (the input as JSON arguments,
  the block's id as the call id, so the reply renders as it was generated); ``thinking`` and
  ``redacted_thinking`` are left out (see :mod:`.blocks`);
- ``tool_choice``: ``auto`` → auto, ``any`` → required, ``tool`` → that function (held to its
  schema by the constraint machinery), ``none`` → none; ``disable_parallel_tool_use`` →
  ``parallel_tool_calls: false``;
- ``stop_sequences`` → ``stop``, ``metadata.user_id`` → ``user``; ``max_tokens`` stays a ceiling
  (the route runs it with ``limit_is_ceiling``).

**The billing-header block.** Claude Code's first system block is a line
``x-anthropic-billing-header: cc_version=…; cc_entrypoint=…;``, and some versions add a
``cch=<checksum>;`` that changes on every request. Left first, it would change the prompt's
first tokens on every turn and no prefix cache could serve anything. Its text is kept, but it
is rendered after the conversation, as a system message just before the reply, so everything
before it (the system prompt, the tools, the history) is the same prefix turn after turn. A
model whose chat template refuses a system message there gets it first, as sent
(:func:`trailing_system_allowed`)."""

from __future__ import annotations

import functools
import json

from superfluid.core.chat import render_chat

from ..openai.chat_protocol import ChatCompletionRequest
from ..typed import parse
from .blocks import (AnthropicDocumentBlock, AnthropicImageBlock, AnthropicMessage, AnthropicTextBlock,
                     AnthropicToolResultBlock, AnthropicToolUseBlock, chat_parts, join_texts)
from .protocol import (MessagesInput, MessagesRequest, ToolChoiceAny, ToolChoiceAuto, ToolChoiceNone,
                       ToolChoiceTool)

VOLATILE_PREFIX = "x-anthropic-billing-header:"


def is_volatile(text: str) -> bool:
    """A system block that changes from request to request without changing the task."""
    return text.lstrip().startswith(VOLATILE_PREFIX)


def system_parts(req: MessagesInput) -> tuple[str | None, str | None]:
    """(the stable system text, the volatile text) of ``system``; either may be None."""
    if req.system is None:
        return None, None
    if isinstance(req.system, str):
        return (None, req.system) if is_volatile(req.system) else (req.system or None, None)
    stable = [b.text for b in req.system if not is_volatile(b.text)]
    volatile = [b.text for b in req.system if is_volatile(b.text)]
    return (join_texts(stable) if stable else None), (join_texts(volatile) if volatile else None)


def _text_of(blocks) -> str:
    return join_texts(b.text for b in blocks if isinstance(b, (AnthropicTextBlock, AnthropicDocumentBlock)))


def _message(msg: AnthropicMessage) -> list[dict]:
    """One Anthropic message as chat messages."""
    if isinstance(msg.content, str):
        return [{"role": msg.role, "content": msg.content}]
    if msg.role == "assistant":
        out: dict = {"role": "assistant", "content": _text_of(msg.content) or None}
        calls = [{"id": b.id, "type": "function",
                  "function": {"name": b.name, "arguments": json.dumps(b.input, ensure_ascii=False)}}
                 for b in msg.content if isinstance(b, AnthropicToolUseBlock)]
        if calls:
            out["tool_calls"] = calls
        elif out["content"] is None:
            out["content"] = ""  # only thinking blocks: an empty turn, kept so the roles still alternate
        return [out]
    results = [{"role": "tool", "tool_call_id": b.tool_use_id, "content": _result_content(b)}
               for b in msg.content if isinstance(b, AnthropicToolResultBlock)]
    own = [b for b in msg.content if isinstance(b, (AnthropicTextBlock, AnthropicDocumentBlock, AnthropicImageBlock))]
    if own or not results:
        results.append({"role": msg.role, "content": chat_parts(own)})
    return results


def _result_content(block: AnthropicToolResultBlock) -> str | list[dict]:
    """A tool result's content as chat's: its text (``Error:`` first when it is one), or parts
    when it holds images (a tool that read an image file)."""
    prefix = "Error: " if block.is_error else ""
    if isinstance(block.content, str) or block.content is None:
        return prefix + (block.content or "")
    return chat_parts(block.content, prefix)


def _tools(req: MessagesInput) -> list[dict]:
    return [{"type": "function", "function": {"name": t.name, "description": t.description or "",
                                              "parameters": t.input_schema}}
            for t in req.tools or () if t.runnable]


def _tool_choice(req: MessagesInput) -> dict:
    choice = req.tool_choice
    out: dict = {}
    if choice is None:
        return out
    if isinstance(choice, ToolChoiceAuto):
        out["tool_choice"] = "auto"
    elif isinstance(choice, ToolChoiceAny):
        out["tool_choice"] = "required"
    elif isinstance(choice, ToolChoiceNone):
        out["tool_choice"] = "none"
    elif isinstance(choice, ToolChoiceTool):
        out["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
    if getattr(choice, "disable_parallel_tool_use", None):
        out["parallel_tool_calls"] = False
    return out


def chat_messages(req: MessagesInput, trailing_system: bool = True) -> list[dict]:
    """The conversation as chat messages, the billing-header block last (or first, when the
    model's template allows no system message there)."""
    stable, volatile = system_parts(req)
    messages = [{"role": "system", "content": stable}] if stable else []
    if volatile and not trailing_system:
        messages.insert(0, {"role": "system", "content": volatile})
    for msg in req.messages:
        messages += _message(msg)
    if volatile and trailing_system:
        messages.append({"role": "system", "content": volatile})
    return messages


def chat_request(req: MessagesInput, trailing_system: bool = True) -> ChatCompletionRequest:
    """The chat request a Messages (or count_tokens) request runs as."""
    body: dict = {"model": req.model, "messages": chat_messages(req, trailing_system)}
    tools = _tools(req)
    if tools:
        body["tools"] = tools
        body.update(_tool_choice(req))
    if req.superfluid is not None:
        body["superfluid"] = req.superfluid.model_dump(exclude_none=True)
    if req.thinking is not None and req.thinking.type in ("enabled", "disabled"):
        # a reasoning model's switch (enable_thinking), and the budget its thinking is held to
        body["chat_template_kwargs"] = {"enable_thinking": req.thinking.type == "enabled"}
        if req.thinking.type == "enabled" and req.thinking.budget_tokens:
            body["thinking_budget"] = req.thinking.budget_tokens
    if isinstance(req, MessagesRequest):
        body.update(max_tokens=req.max_tokens, stream=bool(req.stream))
        if req.stop_sequences:
            body["stop"] = list(req.stop_sequences)
        for field in ("temperature", "top_p", "top_k"):
            if getattr(req, field) is not None:
                body[field] = getattr(req, field)
        if req.metadata is not None and req.metadata.user_id is not None:
            body["user"] = req.metadata.user_id
    return parse(ChatCompletionRequest, body)


def trailing_system_allowed(info) -> bool:
    """Whether a model's chat template (``info``: its engine's info) renders a system message
    after the conversation (ChatML does; templates that insist the system prompt comes first
    raise)."""
    return _renders_trailing_system(info.chat_template, info.bos_token, info.eos_token)


@functools.lru_cache(maxsize=32)
def _renders_trailing_system(template: str | None, bos: str, eos: str) -> bool:
    try:
        render_chat(template, [{"role": "user", "content": "a"}, {"role": "system", "content": "b"}],
                    bos_token=bos, eos_token=eos, add_generation_prompt=True)
        return True
    except Exception:  # InvalidRequest from the template's raise_exception, or a template error
        return False
