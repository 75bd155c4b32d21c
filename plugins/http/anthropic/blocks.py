"""The messages of a Messages request and their content blocks, typed.

Blocks are told apart by ``type`` (a tagged union, so an error names the block and what is wrong
with it, not every type it is not). Every block type of Anthropic's request is decided here:

- ``text``: its text (``cache_control`` and ``citations`` ignored: the prefix cache is automatic);
- ``tool_use`` (assistant) and ``tool_result`` (user): tool calls and their results;
- ``thinking`` and ``redacted_thinking`` (assistant): accepted and left out of the prompt. Their
  text is a previous turn's reasoning (the redacted kind is encrypted, for Anthropic's models
  only); replaying it would cost context and change what a model that does not reason was
  trained to see, and leaving it out keeps a turn's prompt a prefix of the next one's;
- ``document``: a text document (source ``text`` or ``content``) is its text; a PDF or an image
  (source ``base64``, ``url``, ``file``) is refused;
- ``image``: an image (source ``base64`` or ``url``), an image part of the conversation, in the
  message where it was (a ``file`` source, the Files API, is refused);
- any other type (server tool results, search results, container uploads): refused.

Objects are :class:`~..typed.Lenient`: SDKs echo fields of a reply back (``citations``,
``caller``), which are ignored, as Anthropic ignores what it does not need."""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import Discriminator, Field, Tag, ValidationInfo, field_validator, model_validator

from superfluid.core.formats.conversation import ImageRef, Part, TextPart

from ..content import ImagePart
from ..typed import Lenient, fail

CacheControl = dict[str, Any] | None  # accepted and ignored: every prompt's prefix is cached by its tokens


class AnthropicTextBlock(Lenient):
    """``{"type": "text", "text": …}``."""

    type: Literal["text"]
    text: str
    cache_control: CacheControl = Field(None, description="accepted and ignored: the prefix cache is automatic")


IMAGE_TYPES = ("image/png", "image/jpeg", "image/webp", "image/gif")


class AnthropicImageSource(Lenient):
    """``{"type": "base64", "media_type", "data"}`` or ``{"type": "url", "url"}``."""

    type: Literal["base64", "url", "file"]
    media_type: str | None = None
    data: str | None = None
    url: str | None = None
    file_id: str | None = None

    @model_validator(mode="after")
    def _complete(self):
        if self.type == "file":
            raise fail("unsupported_value", "has type \"file\": Files API images are not served; send base64 or a url")
        if self.type == "base64" and (self.data is None or self.media_type is None):
            raise fail("missing_required_parameter", "needs media_type and data with type \"base64\"")
        if self.type == "base64" and self.media_type not in IMAGE_TYPES:
            raise fail("invalid_value", f"media_type must be one of {', '.join(IMAGE_TYPES)}")
        if self.type == "url" and not self.url:
            raise fail("missing_required_parameter", "needs url with type \"url\"")
        return self

    @property
    def as_url(self) -> str:
        return f"data:{self.media_type};base64,{self.data}" if self.type == "base64" else self.url


class AnthropicImageBlock(Lenient):
    """``{"type": "image", "source": …}``: an image, sent on as chat's ``image_url`` part."""

    type: Literal["image"]
    source: AnthropicImageSource
    cache_control: CacheControl = None

    def as_part(self, where: str) -> ImageRef:
        """The image as the conversation holds it (``where``: this block's field, for errors)."""
        return ImageRef(ImagePart(type="image_url", image_url=self.source.as_url), where)


class AnthropicDocumentSource(Lenient):
    """A document's source: ``text`` (``data``) or ``content`` (a string or text blocks) is read;
    a PDF or image (``base64``, ``url``, ``file``) is refused."""

    type: str
    media_type: str | None = None
    data: str | None = None
    content: str | list[AnthropicTextBlock] | None = None

    @model_validator(mode="after")
    def _text_only(self):
        if self.type == "text" and self.data is None:
            raise fail("missing_required_parameter", "needs data with type \"text\"")
        if self.type == "content" and self.content is None:
            raise fail("missing_required_parameter", "needs content with type \"content\"")
        if self.type not in ("text", "content"):
            raise fail("unsupported_value", f"has type {self.type!r}: only text documents (source type "
                                            "\"text\" or \"content\") are supported")
        return self

    @property
    def text(self) -> str:
        if self.type == "text":
            return self.data or ""
        if isinstance(self.content, str):
            return self.content
        return join_texts(b.text for b in self.content or ())


class AnthropicDocumentBlock(Lenient):
    """``{"type": "document", "source": …, "title"?, "context"?}``: a text document."""

    type: Literal["document"]
    source: AnthropicDocumentSource
    title: str | None = None
    context: str | None = None
    cache_control: CacheControl = None

    @property
    def text(self) -> str:
        """The title and context (when given), each on a line before the document's text."""
        return "\n".join(part for part in (self.title, self.context, self.source.text) if part is not None)


class AnthropicToolUseBlock(Lenient):
    """A call the assistant made (history): ``{"type": "tool_use", "id", "name", "input"}``."""

    type: Literal["tool_use"]
    id: Annotated[str, Field(min_length=1)]
    name: Annotated[str, Field(min_length=1)]
    input: dict[str, Any]
    cache_control: CacheControl = None


def _part_kind(value) -> str | None:
    return _tag(value, {"text": "AnthropicTextBlock", "image": "AnthropicImageBlock",
                        "document": "AnthropicDocumentBlock"})


ResultPart = Annotated[
    Union[Annotated[AnthropicTextBlock, Tag("AnthropicTextBlock")],
          Annotated[AnthropicImageBlock, Tag("AnthropicImageBlock")],
          Annotated[AnthropicDocumentBlock, Tag("AnthropicDocumentBlock")]],
    Discriminator(_part_kind, custom_error_type="invalid_value",
                  custom_error_message="a tool result's block must have type text, image or document")]


class AnthropicToolResultBlock(Lenient):
    """A tool's result (user): ``{"type": "tool_result", "tool_use_id", "content"?, "is_error"?}``."""

    type: Literal["tool_result"]
    tool_use_id: Annotated[str, Field(min_length=1)]
    content: str | list[ResultPart] | None = Field("", description="a string or text/document blocks")
    is_error: bool | None = Field(False, description="the result is marked as an error in the prompt")
    cache_control: CacheControl = None

    @property
    def text(self) -> str:
        if isinstance(self.content, str) or self.content is None:
            return self.content or ""
        return join_texts(part.text for part in self.content if not isinstance(part, AnthropicImageBlock))


class AnthropicThinkingBlock(Lenient):
    """A previous turn's reasoning: accepted and left out of the prompt."""

    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class AnthropicRedactedThinkingBlock(Lenient):
    """A previous turn's encrypted reasoning: accepted and left out of the prompt."""

    type: Literal["redacted_thinking"]
    data: str


_BLOCKS = {"text": "AnthropicTextBlock", "image": "AnthropicImageBlock", "document": "AnthropicDocumentBlock",
           "tool_use": "AnthropicToolUseBlock", "tool_result": "AnthropicToolResultBlock",
           "thinking": "AnthropicThinkingBlock", "redacted_thinking": "AnthropicRedactedThinkingBlock"}


def _tag(value, tags: dict[str, str]) -> str | None:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return tags.get(kind) if isinstance(kind, str) else None


def _block_kind(value) -> str | None:
    return _tag(value, _BLOCKS)


Block = Annotated[
    Union[Annotated[AnthropicTextBlock, Tag("AnthropicTextBlock")],
          Annotated[AnthropicImageBlock, Tag("AnthropicImageBlock")],
          Annotated[AnthropicDocumentBlock, Tag("AnthropicDocumentBlock")],
          Annotated[AnthropicToolUseBlock, Tag("AnthropicToolUseBlock")],
          Annotated[AnthropicToolResultBlock, Tag("AnthropicToolResultBlock")],
          Annotated[AnthropicThinkingBlock, Tag("AnthropicThinkingBlock")],
          Annotated[AnthropicRedactedThinkingBlock, Tag("AnthropicRedactedThinkingBlock")]],
    Discriminator(_block_kind, custom_error_type="invalid_value",
                  custom_error_message="a content block must have type text, document, tool_use, tool_result, "
                                       "thinking, redacted_thinking or image")]

_ONLY = {"tool_use": "assistant", "tool_result": "user", "thinking": "assistant", "redacted_thinking": "assistant"}


class AnthropicMessage(Lenient):
    """One message: ``user``, ``assistant`` or ``system`` (a system message in the conversation,
    text only); content a string or a list of blocks."""

    role: Literal["user", "assistant", "system"]
    content: str | list[Block]

    @field_validator("content")
    @classmethod
    def _blocks_fit_the_role(cls, content, info: ValidationInfo):
        role = info.data.get("role")
        for i, block in enumerate(content if isinstance(content, list) else ()):
            if role == "system" and block.type != "text":
                raise fail("invalid_value", f"[{i}]: a system message holds only text blocks")
            owner = _ONLY.get(block.type)
            if owner is not None and owner != role:
                raise fail("invalid_value", f"[{i}] is a {block.type} block, which only {owner} messages hold")
        return content


def parts(blocks, where: str, prefix: str = "") -> tuple[Part, ...]:
    """Text, document and image blocks (``(j, block)`` pairs: each block with its index in the
    list ``where`` names) as a message's parts: consecutive text blocks joined as
    :func:`join_texts` joins them (after ``prefix``), each image where it was (its errors name
    ``{where}[j].source``)."""
    out: list[Part] = [TextPart(prefix)] if prefix else []
    run: list[str] = []
    for j, b in blocks:
        if isinstance(b, AnthropicImageBlock):
            if run:
                out.append(TextPart(join_texts(run)))
                run = []
            out.append(b.as_part(f"{where}[{j}].source"))
        else:
            run.append(b.text)
    if run:
        out.append(TextPart(join_texts(run)))
    return tuple(p for p in out if not isinstance(p, TextPart) or p.text)


def join_texts(texts) -> str:
    """Consecutive text blocks as one text: joined by a blank line, so blocks a client keeps
    apart (Claude Code's reminders and the prompt) stay apart in the prompt."""
    return "\n\n".join(texts)
