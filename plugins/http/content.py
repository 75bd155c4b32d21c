"""The content of a message, one type for every front end.

A message's content is a string or a list of parts. Today a part is text; image parts join
:data:`ContentPart` as members of a union told apart by ``type`` (media lanes), and every front
end (OpenAI chat, sessions, and the Messages, Responses and Ollama APIs as they arrive) maps its
own blocks onto these parts, so the preparation path reads one shape."""

from __future__ import annotations

from typing import Literal

from .typed import Lenient


class TextPart(Lenient):
    """``{"type": "text", "text": ...}``."""

    type: Literal["text"]
    text: str


ContentPart = TextPart  # media parts (image_url, ...) join here as a union on ``type``
Content = str | list[ContentPart]


def content_text(content: Content | None) -> str:
    """The text of a content: a string as it is, parts joined with nothing between them (as
    OpenAI concatenates text parts); None is ""."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part.text for part in content)
