"""The content of a message, one type for every front end.

A message's content is a string or a list of parts: text, or an image (``image_url``, OpenAI's
shape). The prompt is rendered from the conversation each front end maps its request onto
(:class:`superfluid.core.formats.conversation.Conversation`); an image there is an
:class:`~superfluid.core.formats.conversation.ImageRef` holding an :class:`ImagePart`, so every
front end's images (an Anthropic ``image`` block, a Responses ``input_image``, an Ollama
``images`` entry) are loaded and kept the same way.

An image part is only a reference when it is parsed (a ``data:`` URL, or an ``http(s)`` one); the
route decodes and checks it before the request is prepared (:mod:`.images`), and keeps the
result on the part (:attr:`ImagePart.image`)."""

from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import Discriminator, Field, PrivateAttr, Tag

from superfluid.core.media import Image

from .typed import Lenient


class TextPart(Lenient):
    """``{"type": "text", "text": ...}``."""

    type: Literal["text"]
    text: str


class ImageUrl(Lenient):
    url: Annotated[str, Field(min_length=1, description="a data: URL (base64), or an http(s) URL the server "
                                                        "is allowed to fetch (--image-url-allow)")]
    detail: Literal["auto", "low", "high"] | None = Field(
        None, description="accepted; every image is sent at the model's tile size")


class ImagePart(Lenient):
    """``{"type": "image_url", "image_url": {"url": ..., "detail": ...}}`` (the bare URL string
    is accepted for ``image_url`` too, as vLLM and llama-server accept it)."""

    type: Literal["image_url"]
    image_url: ImageUrl | str
    _image: Image | None = PrivateAttr(None)

    @property
    def url(self) -> str:
        return self.image_url if isinstance(self.image_url, str) else self.image_url.url

    @property
    def image(self) -> Image | None:
        """The decoded image, once the route has loaded it (None before)."""
        return self._image

    def loaded(self, image: Image) -> None:
        self._image = image


def _part_kind(value) -> str | None:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return {"text": "TextPart", "image_url": "ImagePart"}.get(kind) if isinstance(kind, str) else None


# tags are class-like names, which a 400's field name leaves out (typed.param_of)
ContentPart = Annotated[Union[Annotated[TextPart, Tag("TextPart")], Annotated[ImagePart, Tag("ImagePart")]],
                        Discriminator(_part_kind, custom_error_type="invalid_value",
                                      custom_error_message="a content part must have type text or image_url")]
Content = str | list[ContentPart]


def content_text(content: Content | None) -> str:
    """The text of a content: a string as it is, text parts joined with nothing between them (as
    OpenAI concatenates text parts), images left out; None is ""."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part.text for part in content if isinstance(part, TextPart))
