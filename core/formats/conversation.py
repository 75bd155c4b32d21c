"""One conversation, whichever API it came in through.

Chat Completions, Messages, Responses and Ollama each map their typed request straight onto
this value: messages with typed parts (text, images), tool calls whose arguments are objects
where they parse, an assistant's reasoning, the call a tool result answers. The prompt renderer
reads only this value, so no front end writes another's request body for it to parse again, and
what a chat template is given (a string or typed parts, arguments as objects or JSON text, ids
as the template wants them) is decided in one place, :mod:`.template_messages`.

An image is a part that holds the front end's reference to it (:attr:`ImageRef.ref`: whatever
that front end needs to fetch, decode and keep its pixels; core never looks inside) and the
request field it came from (:attr:`ImageRef.where`), which an error about it names."""

from __future__ import annotations

import json
from typing import Union

import attrs


@attrs.frozen
class TextPart:
    text: str


@attrs.frozen(eq=False)
class ImageRef:
    """An image where it was in a message. ``ref``: the front end's own image object (opaque
    here); ``where``: the field that sent it (``messages[0].content[1].image_url.url``)."""

    ref: object
    where: str = ""


Part = Union[TextPart, ImageRef]


def _arguments(value: dict | str | None) -> dict | str:
    """Arguments as an object where they parse as one; otherwise the text as sent."""
    if isinstance(value, dict):
        return value
    try:
        parsed = json.loads(value or "{}")
    except ValueError:
        return value or ""
    return parsed if isinstance(parsed, dict) else (value or "")


@attrs.frozen
class ToolCall:
    """A call an assistant turn made. ``arguments``: an object where they parse as one (the
    text as sent otherwise); ``sent``: the JSON text the client sent (None when it sent an
    object), kept so that a template that takes text renders the call exactly as the model
    wrote it and the prefix cache still serves the turn."""

    id: str
    name: str
    arguments: dict | str = attrs.field(factory=dict)
    sent: str | None = None

    @classmethod
    def of(cls, call_id: str, name: str, arguments: dict | str | None) -> "ToolCall":
        """A call from its arguments as a client sends them: an object, or JSON text."""
        if isinstance(arguments, dict):
            return cls(call_id, name, arguments)
        return cls(call_id, name, _arguments(arguments), arguments if arguments is not None else "{}")

    @property
    def text(self) -> str:
        """The arguments as JSON text: as sent, else written with ``json.dumps``."""
        if self.sent is not None:
            return self.sent
        return self.arguments if isinstance(self.arguments, str) else json.dumps(self.arguments, ensure_ascii=False)


def parts_of(text: str | None) -> tuple[Part, ...]:
    """A plain text as parts (none for an empty or absent text)."""
    return (TextPart(text),) if text else ()


@attrs.frozen
class Message:
    """One message. ``role``: system, developer, user, assistant or tool (a template is given
    developer as system); ``reasoning``: an assistant's reasoning, which some templates render;
    ``tool_call_id``: the call a tool message answers; ``name``: the author's name."""

    role: str
    parts: tuple[Part, ...] = ()
    tool_calls: tuple[ToolCall, ...] = ()
    reasoning: str | None = None
    tool_call_id: str | None = None
    name: str | None = None

    @classmethod
    def plain(cls, role: str, text: str | None, **fields) -> "Message":
        """A message whose content is one text."""
        return cls(role, parts_of(text), **fields)

    @property
    def text(self) -> str:
        """The text parts joined with nothing between them (as OpenAI joins them), images left out."""
        return "".join(p.text for p in self.parts if isinstance(p, TextPart))

    @property
    def images(self) -> tuple[ImageRef, ...]:
        return tuple(p for p in self.parts if isinstance(p, ImageRef))

    @property
    def has_content(self) -> bool:
        """Whether the message says anything besides its calls (an image counts)."""
        return any(isinstance(p, ImageRef) or p.text for p in self.parts)


@attrs.frozen
class Conversation:
    """The messages of one chat request, in order."""

    messages: tuple[Message, ...] = attrs.field(default=(), converter=tuple)

    def images(self) -> list[ImageRef]:
        """Every image, in the order the messages hold them (the order a template renders them)."""
        return [image for m in self.messages for image in m.images]

    def __add__(self, other: "Conversation") -> "Conversation":
        return Conversation(self.messages + other.messages)
