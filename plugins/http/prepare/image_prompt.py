"""A chat's prompt with images in it: rendered by the chat template with a marker where each
image was, then tokenized piece by piece with each marker replaced by the image's tokens (the
model's image-start tokens, one placeholder per embedding row, its image-end tokens) and the
positions its rows fill (:class:`superfluid.core.media.MediaSpan`).

A marker is a private-use character pair around the image's number, which no chat template
writes and which tokenizes to nothing the template could split. A rendered prompt whose markers
do not name each image exactly once (a template that drops a message, or user text that holds
the reserved characters) is refused rather than guessed at."""

from __future__ import annotations

import hashlib
import re

from superfluid.core.errors import InvalidRequest
from superfluid.core.media import Image, MediaSpan

from ..content import ImagePart

_OPEN, _CLOSE = "\ue000", "\ue001"
_MARKER = re.compile(f"{_OPEN}(\\d+){_CLOSE}")


class ImageMarkers:
    """Numbers a chat's image parts in the order the messages are rendered (its
    :meth:`__call__` is a message's ``image_marker``)."""

    def __init__(self) -> None:
        self.images: list[ImagePart] = []

    def __call__(self, part: ImagePart) -> str:
        self.images.append(part)
        return f"{_OPEN}{len(self.images) - 1}{_CLOSE}"


def stand_in(part: ImagePart) -> Image:
    """An image not loaded yet (a prompt only being counted): its tokens are those of any image
    of the model, so the count is exact; its content is named by its URL."""
    return Image(width=0, height=0, pixels=b"", digest=hashlib.sha256(part.url.encode()).hexdigest())


def tokenize_with_images(runtime, text: str, images: list[ImagePart], first_tokens) -> tuple[list[int], tuple[MediaSpan, ...]]:
    """(tokens, spans) of a rendered prompt holding image markers. ``first_tokens`` tokenizes
    the text before the first image (it decides on BOS); the rest is tokenized without special
    tokens added."""
    vision = runtime.engine.info.vision
    pieces = _MARKER.split(text)
    tokens = first_tokens(pieces[0])
    spans: list[MediaSpan] = []
    seen: set[int] = set()
    for number, piece in zip(pieces[1::2], pieces[2::2]):
        index = int(number)
        if index >= len(images) or index in seen:
            raise InvalidRequest("the prompt holds the reserved characters U+E000/U+E001 that mark images; "
                                 "remove them from the text", param="messages", code="invalid_value")
        seen.add(index)
        part = images[index]
        image = part.image if part.image is not None else stand_in(part)
        spans.append(MediaSpan(image=image, start=len(tokens) + len(vision.before), rows=vision.rows))
        tokens += vision.prompt_tokens(image)
        if piece:
            tokens += runtime.engine.tokenize(piece, add_special=False, parse_special=True)
    if len(seen) != len(images):
        raise InvalidRequest(f"the model's chat template left out {len(images) - len(seen)} of the "
                             f"{len(images)} images", param="messages", code="invalid_value")
    return tokens, tuple(spans)
