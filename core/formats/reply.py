"""What a reply reads as: content, reasoning and tool calls (:class:`ParsedReply`).

Arguments are JSON text, as OpenAI carries them. A format that reads a call from JSON the model
wrote keeps the model's own text (so a partial read is a prefix of the whole one); a format whose
calls are not JSON (XML parameters, ``name[ARGS]``...) writes the JSON itself with
:func:`arguments_json`, whose partial form (:func:`partial_arguments_json`) is likewise a prefix
of the complete one."""

from __future__ import annotations

import json
import uuid

import attrs


@attrs.frozen
class ParsedCall:
    """One tool call read from a reply. ``arguments``: JSON text (while the reply streams, maybe
    an unfinished prefix of it, "" before any of it is written); ``id``: the id the model wrote (Mistral's ``[CALL_ID]``, Kimi's
    ``functions.NAME:0``), or None for one the server makes up."""

    name: str
    arguments: str = "{}"
    id: str | None = None

    def arguments_object(self):
        """The arguments parsed (None if they are not a complete JSON value)."""
        try:
            return json.loads(self.arguments)
        except ValueError:
            return None


@attrs.frozen
class ParsedReply:
    """A reply read by its family's formats: the answer (``content``), the reasoning span's text
    (``reasoning``), and the calls, in the order written."""

    content: str = ""
    reasoning: str = ""
    calls: tuple[ParsedCall, ...] = ()

    def openai_message(self, call_ids: list[str] | None = None) -> dict:
        """The assistant message in OpenAI's shape (``content`` None when empty and there are
        calls; ``reasoning_content`` when there is reasoning; ``arguments`` JSON strings)."""
        message: dict = {"role": "assistant", "content": self.content or (None if self.calls else "")}
        if self.reasoning:
            message["reasoning_content"] = self.reasoning
        if self.calls:
            ids = call_ids or [c.id or new_call_id() for c in self.calls]
            message["tool_calls"] = [{"id": i, "type": "function",
                                      "function": {"name": c.name, "arguments": c.arguments}}
                                     for i, c in zip(ids, self.calls)]
        return message


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def arguments_json(args: dict) -> str:
    """A call's arguments as JSON text, as every format that builds them writes them."""
    return json.dumps(args, ensure_ascii=False)


def partial_arguments_json(args: dict) -> str:
    """The arguments read so far of a call still being written: :func:`arguments_json` of them
    without its closing brace, so that it is a prefix of the complete call's text however many
    more arguments follow (an empty object gives ``{``)."""
    text = arguments_json(args)
    return text[:-1]
