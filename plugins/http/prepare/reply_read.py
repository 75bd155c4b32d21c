"""How a chat's reply is read, and what it reads as in OpenAI's terms.

One :class:`~superfluid.core.formats.reader.ReplyReader` per request, from its tool plan (the
family's call syntax, the offered tools, a forced call's pre-fill) and its reasoning (the span's
format, whether the prompt opened it). A reply whose calls do not read as calls of offered tools
is content: never an error, since the model wrote it."""

from __future__ import annotations

import attrs

from superfluid.core.formats.reader import ReplyReader
from superfluid.core.formats.reply import ParsedReply, new_call_id

from .tool_format import ToolPlan


@attrs.define
class Parsed:
    """A reply read: its content (None when empty beside calls), its calls in OpenAI's shape,
    its reasoning, and its finish reason (``tool_calls`` when it ended by making calls)."""

    content: str | None
    calls: list[dict]
    finish_reason: str
    reasoning: str = ""


def reader(tools: ToolPlan, thinks=None) -> ReplyReader:
    """The reader of a chat's reply (``thinks``: its :class:`~.reasoning.Reasoning`, or None)."""
    fmt = tools.fmt if tools.active or getattr(tools.fmt, "reads_reasoning", False) else None
    if fmt is not None and tools.active:
        fmt = fmt.knowing_strings(string_parameters(tools.tools))
    return ReplyReader(
        tool_format=fmt, reasoning=thinks.format if thinks is not None else None,
        tools=frozenset(tools.names) if tools.active else frozenset(),
        forced=tools.name if tools.choice == "function" else None, parallel=tools.parallel,
        inside=bool(thinks is not None and thinks.inside), prefill=tools.prefill)


def string_parameters(tools) -> dict[str, frozenset[str]]:
    """Per offered tool, the parameters its schema declares strings (what a format that writes
    values raw needs to keep ``75001`` a string)."""
    out = {}
    for tool in tools:
        fn = tool["function"]
        props = (fn.get("parameters") or {}).get("properties") or {}
        out[fn["name"]] = frozenset(k for k, v in props.items() if isinstance(v, dict) and v.get("type") == "string")
    return out


def parsed(reply: ParsedReply, finish_reason: str, ids: list[str] | None = None) -> Parsed:
    """``reply`` in OpenAI's terms; ``ids``: the ids its calls were streamed with."""
    ids = list(ids or ())
    ids += [c.id or new_call_id() for c in reply.calls[len(ids):]]
    calls = [{"id": i, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
             for i, c in zip(ids, reply.calls)]
    finish = "tool_calls" if calls and finish_reason == "stop" else finish_reason
    return Parsed(reply.content or (None if calls else ""), calls, finish, reply.reasoning)
