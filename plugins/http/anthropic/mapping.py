"""A typed Messages request as the chat the OpenAI front end runs: its conversation
(:class:`~superfluid.core.formats.conversation.Conversation`, mapped here block by block) and
chat's generation fields.

- ``system`` → a system message first (its text blocks joined by a blank line); a system
  message in ``messages`` stays where it is;
- a user message's ``tool_result`` blocks → ``tool`` messages (in order, before the user's own
  text, as chat templates expect them right after the calls); ``is_error`` puts ``Error:`` before
  the result's text;
- an assistant message's ``tool_use`` blocks → its tool calls (the input as the arguments
  object, the block's id as the call id, so the reply renders as it was generated); ``thinking`` and
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

from superfluid.core.chat import render_chat
from superfluid.core.formats.conversation import Conversation, Message, ToolCall, parts_of

from ..openai.chat_protocol import MappedChat
from .blocks import (AnthropicDocumentBlock, AnthropicImageBlock, AnthropicMessage, AnthropicTextBlock,
                     AnthropicToolResultBlock, AnthropicToolUseBlock, join_texts, parts)
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


def _message(msg: AnthropicMessage, index: int) -> list[Message]:
    """One Anthropic message (``messages[index]``) as the conversation's messages."""
    if isinstance(msg.content, str):
        return [Message.plain(msg.role, msg.content)]
    where = f"messages[{index}].content"
    if msg.role == "assistant":
        # only thinking blocks: an empty turn, kept so the roles still alternate
        calls = tuple(ToolCall(b.id, b.name, b.input) for b in msg.content if isinstance(b, AnthropicToolUseBlock))
        return [Message.plain("assistant", _text_of(msg.content), tool_calls=calls)]
    results = [Message("tool", _result_parts(b, f"{where}[{j}].content"), tool_call_id=b.tool_use_id)
               for j, b in enumerate(msg.content) if isinstance(b, AnthropicToolResultBlock)]
    own = [(j, b) for j, b in enumerate(msg.content)
           if isinstance(b, (AnthropicTextBlock, AnthropicDocumentBlock, AnthropicImageBlock))]
    if own or not results:
        results.append(Message(msg.role, parts(own, where)))
    return results


def _result_parts(block: AnthropicToolResultBlock, where: str) -> tuple:
    """A tool result's content as parts: its text (``Error:`` first when it is one), with its
    images where they were (a tool that read an image file)."""
    prefix = "Error: " if block.is_error else ""
    if isinstance(block.content, str) or block.content is None:
        return parts_of(prefix + (block.content or ""))
    return parts(enumerate(block.content), where, prefix)


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


def conversation(req: MessagesInput, trailing_system: bool = True) -> Conversation:
    """The request's conversation, the billing-header block last (or first, when the model's
    template allows no system message there)."""
    stable, volatile = system_parts(req)
    messages = [Message.plain("system", stable)] if stable else []
    if volatile and not trailing_system:
        messages.insert(0, Message.plain("system", volatile))
    for i, msg in enumerate(req.messages):
        messages += _message(msg, i)
    if volatile and trailing_system:
        messages.append(Message.plain("system", volatile))
    return Conversation(messages)


def chat_fields(req: MessagesInput) -> dict:
    """Chat's generation fields for the request (its model, tools, sampling, limits)."""
    body: dict = {"model": req.model}
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
    return body


def chat_request(req: MessagesInput, trailing_system: bool = True) -> MappedChat:
    """The chat a Messages (or count_tokens) request runs as."""
    return MappedChat.of(conversation(req, trailing_system), chat_fields(req))


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
