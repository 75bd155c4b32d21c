"""A reply split into content and tool calls, whole or as it streams.

Replies are parsed for ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks, or a
reply that is nothing but such a JSON object (or a list of them). A reply whose calls do not
parse, or name an undeclared tool, is content: never an error, since the model wrote it."""

from __future__ import annotations

import json
import uuid

import attrs

from .tool_format import CLOSE, OPEN, ToolPlan

_DECODER = json.JSONDecoder()


@attrs.define
class Parsed:
    content: str | None
    calls: list[dict]
    finish_reason: str


def new_call(name: str, arguments: dict) -> dict:
    return {"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}


def _call(obj, tools: ToolPlan) -> dict | None:
    """A parsed JSON value as a call to a declared tool, or None."""
    if not isinstance(obj, dict) or obj.get("name") not in tools.names:
        return None
    if tools.choice == "function" and obj["name"] != tools.name:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    return new_call(obj["name"], args) if isinstance(args, dict) else None


def _tagged(text: str, tools: ToolPlan):
    """(outside text, calls) for ``<tool_call>`` blocks, or None if any block is not a valid call."""
    outside, calls, pos = [], [], 0
    while (start := text.find(OPEN, pos)) >= 0:
        outside.append(text[pos:start])
        i = start + len(OPEN)
        i += len(text[i:]) - len(text[i:].lstrip())
        try:
            obj, i = _DECODER.raw_decode(text, i)
        except ValueError:
            return None
        call = _call(obj, tools)
        if call is None:
            return None
        calls.append(call)
        rest = text[i:].lstrip()
        pos = len(text) - len(rest) + len(CLOSE) if rest.startswith(CLOSE) else i
    outside.append(text[pos:])
    return "".join(outside), calls


def _bare(text: str, tools: ToolPlan) -> list[dict] | None:
    """A reply that is nothing but a call object, or a list of them (Llama 3 style)."""
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    calls = [_call(o, tools) for o in (obj if isinstance(obj, list) else [obj])]
    return calls if calls and all(calls) else None


def parse(text: str, finish_reason: str, tools: ToolPlan) -> Parsed:
    """Split a reply (the pre-fill included) into content and calls. A reply whose calls do not
    parse, or name an undeclared tool, is returned whole as content: never an error."""
    whole = Parsed(text, [], finish_reason)
    if OPEN in text:
        found = _tagged(text, tools)
        if found is None:
            return whole
        content, calls = found
    elif text.lstrip()[:1] in ("{", "["):
        calls, content = _bare(text.strip(), tools), ""
        if calls is None:
            return whole
    else:
        return whole
    if not tools.parallel:
        calls = calls[:1]
    content = content.rstrip() or None
    return Parsed(content, calls, "tool_calls" if finish_reason == "stop" else finish_reason)


class StreamParser:
    """Streams a reply's content as it comes and holds back whatever may turn out to be a call:
    from the first ``<tool_call>`` (or the start of one) on, or all of a reply that begins like a
    bare JSON call. What it emits is always a prefix of ``parse(...).content``, so the streamed
    reply assembles to exactly the non-streamed one."""

    def __init__(self, tools: ToolPlan):
        self.tools = tools
        self.text = tools.prefill
        self.sent = 0

    def _safe(self) -> int:
        text = self.text
        head = text.lstrip()
        if not head or head[0] in "{[":
            return 0
        cut = text.find(OPEN)
        if cut < 0:
            cut = len(text)
            for k in range(min(len(OPEN) - 1, len(text)), 0, -1):
                if text.endswith(OPEN[:k]):
                    cut -= k
                    break
        return len(text[:cut].rstrip())

    def feed(self, delta: str) -> str:
        self.text += delta
        safe = self._safe()
        if safe <= self.sent:
            return ""
        out, self.sent = self.text[self.sent:safe], safe
        return out

    def finish(self, finish_reason: str) -> tuple[str, Parsed]:
        """(content not yet sent, the parsed reply)."""
        parsed = parse(self.text, finish_reason, self.tools)
        content = parsed.content or ""
        return content[self.sent:], parsed


def stream_deltas(calls: list[dict]) -> list[dict]:
    """``delta.tool_calls`` entries: one per call, whole (clients concatenate by ``index``)."""
    return [{"index": i, **call} for i, call in enumerate(calls)]
