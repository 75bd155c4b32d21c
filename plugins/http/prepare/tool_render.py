"""A chat prompt with tools, over any chat template, and the family syntax its replies are read in.

A template that renders ``tools`` gets them (the model then sees the format it was trained on,
and its replies are read in its family's syntax, :func:`reply_format`);
for one that does not, the tools are described in a system message in the Hermes format, and
tool calls and results in the history are written as text in that same format, so any chat model
can call tools. The rendering is deterministic, so a turn's prompt starts with the previous
turn's and the prefix cache serves it. A forced call's pre-fill ends the prompt."""

from __future__ import annotations

import json

import attrs

from superfluid.core.chat import render_chat, template_caps
from superfluid.core.formats.conversation import Conversation, Message, TextPart
from superfluid.core.formats.template_messages import content_caps, template_messages

from .image_prompt import marker, render_images
from .tool_format import ToolPlan, call_text

SYSTEM = (
    "# Tools\n\n"
    "You may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n"
    "<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n"
    "<tool_call>\n{{\"name\": <function-name>, \"arguments\": <args-json-object>}}\n</tool_call>")


def _as_text(conversation: Conversation, caps, native: bool) -> Conversation:
    """History the template cannot render, rewritten deterministically as Hermes text (a
    message's images stay where they were)."""
    out: list[Message] = []
    results: set[int] = set()  # the user turns that hold tool results (consecutive ones share one)
    for msg in conversation.messages:
        if msg.tool_calls and not (native and caps.tool_calls):
            calls = "\n".join(call_text(c.name, c.arguments) for c in msg.tool_calls)
            parts = (*msg.parts, TextPart("\n" + calls)) if msg.has_content else (TextPart(calls),)
            msg = attrs.evolve(msg, parts=parts, tool_calls=())
        elif msg.role == "tool" and not (native and caps.tool_role):
            wrapped = (TextPart("<tool_response>\n"), *msg.parts, TextPart("\n</tool_response>"))
            if not caps.tool_role:  # as a user turn; consecutive results share one
                if out and len(out) - 1 in results:
                    out[-1] = attrs.evolve(out[-1], parts=(*out[-1].parts, TextPart("\n"), *wrapped))
                    continue
                results.add(len(out))
                out.append(Message("user", wrapped))
                continue
            msg = attrs.evolve(msg, parts=wrapped)
        out.append(msg)
    return Conversation(out)


def _with_system_block(conversation: Conversation, tools: ToolPlan) -> Conversation:
    """The tools described in the system message (one is added if the history has none)."""
    block = SYSTEM.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools.tools))
    messages = conversation.messages
    if messages and messages[0].role in ("system", "developer"):
        first = attrs.evolve(messages[0], parts=(*messages[0].parts, TextPart("\n\n" + block)))
        return Conversation((first, *messages[1:]))
    return Conversation((Message.plain("system", block), *messages))


HERMES = "hermes"  # the format the fallback system message asks for


def reply_format(chat, daemon):
    """The tool-call format a model's replies are read with (``chat``: its
    :class:`~superfluid.core.formats.setup.ChatSetup`): its family's, when its template renders
    the tools (the model is shown its own format) or its ``tool-call-parser`` names one; Hermes
    when the tools are described by the fallback system message, which asks for Hermes calls."""
    detected = chat.detected
    if detected.tool_format is not None and (detected.tool_source != "auto" or
                                             (chat.template and template_caps(chat.template).tools)):
        return detected.tool_format
    if detected.tool_source != "auto" and detected.tool_format is None:
        return None  # tool-call-parser none: replies are never read for calls
    formats = getattr(daemon, "formats", None)
    return formats.tool_formats.get(HERMES) if formats is not None else None


def render_prompt(template: str | None, conversation: Conversation, tools: ToolPlan, **kw) -> str:
    """The prompt text: the template's own tool rendering where it has one, else the Hermes system
    message; images where the template puts them (:func:`.image_prompt.render_images`); then the
    forced opening of a call, if any."""
    caps = template_caps(template) if template else None
    if caps is None:
        return render_chat(template, template_messages(conversation), **kw)  # raises: no template
    native = caps.tools
    if any(m.tool_calls or m.role == "tool" for m in conversation.messages):
        conversation = _as_text(conversation, caps, native)
    offered = {"tools": list(tools.tools)} if tools.active and native else {}
    if tools.active and not native:
        conversation = _with_system_block(conversation, tools)
    content, thinking = content_caps(template), "thinking" in template

    def render(typed_images: bool) -> str:
        messages = template_messages(conversation, caps, content, image_text=marker, typed_images=typed_images,
                                                  thinking=thinking)
        return render_chat(template, messages, **offered, **kw)

    text = render_images(render, content, len(conversation.images()))
    return text + (tools.prefill if tools.active else "")
