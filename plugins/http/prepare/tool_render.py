"""A chat prompt with tools, over any chat template, and the family syntax its replies are read in.

A template that renders ``tools`` gets them (the model then sees the format it was trained on,
and its replies are read in its family's syntax, :func:`reply_format`);
for one that does not, the tools are described in a system message in the Hermes format, and
tool calls and results in the history are written as text in that same format, so any chat model
can call tools. The rendering is deterministic, so a turn's prompt starts with the previous
turn's and the prefix cache serves it. A forced call's pre-fill ends the prompt."""

from __future__ import annotations

import hashlib
import json

from superfluid.core.chat import render_chat, template_caps

from .tool_format import ToolPlan, arguments, call_text

SYSTEM = (
    "# Tools\n\n"
    "You may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n"
    "<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n"
    "<tool_call>\n{{\"name\": <function-name>, \"arguments\": <args-json-object>}}\n</tool_call>")


def _as_text(messages: list[dict], caps, native: bool) -> list[dict]:
    """History the template cannot render, rewritten deterministically as Hermes text."""
    out: list[dict] = []
    for msg in messages:
        if msg.get("tool_calls") and not (native and caps.tool_calls):
            calls = "\n".join(call_text(c["function"]["name"], c["function"].get("arguments"))
                              for c in msg["tool_calls"])
            text = f"{msg['content']}\n{calls}" if msg["content"] else calls
            msg = {k: v for k, v in msg.items() if k != "tool_calls"} | {"content": text}
        elif msg.get("tool_calls") and (caps.object_arguments or caps.short_ids):
            msg = msg | {"tool_calls": [c | {"id": _call_id(c.get("id"), caps), "function": c["function"] | {
                "arguments": arguments(c["function"].get("arguments")) if caps.object_arguments
                else c["function"].get("arguments")}} for c in msg["tool_calls"]]}
        elif msg["role"] == "tool" and not (native and caps.tool_role):
            result = f"<tool_response>\n{msg['content']}\n</tool_response>"
            if not caps.tool_role:  # as a user turn; consecutive results share one
                if out and out[-1].get("_results"):
                    out[-1]["content"] += "\n" + result
                    continue
                out.append({"role": "user", "content": result, "_results": True})
                continue
            msg = msg | {"content": result}
        elif msg["role"] == "tool" and caps.short_ids:
            msg = msg | {"tool_call_id": _call_id(msg.get("tool_call_id"), caps)}
        out.append(msg)
    return [{k: v for k, v in m.items() if k != "_results"} for m in out]


def _call_id(call_id: str | None, caps) -> str | None:
    """A call's id as the template takes it: for one that wants 9 letters and digits (Mistral's),
    a stable digest of the client's id, so a call and its result still match and every turn
    renders the same prefix."""
    if not caps.short_ids or call_id is None or (len(call_id) == 9 and call_id.isalnum()):
        return call_id
    return hashlib.sha256(call_id.encode()).hexdigest()[:9]


def _with_system_block(messages: list[dict], tools: ToolPlan) -> list[dict]:
    """The tools described in the system message (one is added if the history has none)."""
    block = SYSTEM.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools.tools))
    if messages[0]["role"] == "system":
        return [messages[0] | {"content": f"{messages[0]['content']}\n\n{block}"}, *messages[1:]]
    return [{"role": "system", "content": block}, *messages]


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


def _with_thinking(message: dict) -> dict:
    """An assistant turn's reasoning also as ``thinking``, the key gpt-oss' and LFM2.5's templates
    read it from (gpt-oss refuses a call turn with both content and thinking: such a turn keeps
    its content and drops the thinking, as its template asks)."""
    thought = message.get("reasoning_content")
    if thought is None or (message.get("tool_calls") and message.get("content")):
        return message
    return message | {"thinking": thought}


def render_prompt(template: str | None, messages: list[dict], tools: ToolPlan, **kw) -> str:
    """The prompt text: the template's own tool rendering where it has one, else the Hermes system
    message; then the forced opening of a call, if any."""
    caps = template_caps(template) if template else None
    if caps is None:
        return render_chat(template, messages, **kw)  # raises: no template
    native = caps.tools
    if any(m.get("tool_calls") or m["role"] == "tool" for m in messages):
        messages = _as_text(messages, caps, native)
    if "thinking" in template and any("reasoning_content" in m for m in messages):
        messages = [_with_thinking(m) for m in messages]
    if tools.active and native:
        text = render_chat(template, messages, tools=list(tools.tools), **kw)
    else:
        text = render_chat(template, _with_system_block(messages, tools) if tools.active else messages, **kw)
    return text + (tools.prefill if tools.active else "")
