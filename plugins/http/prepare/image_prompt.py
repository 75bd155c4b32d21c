"""A chat's prompt with images in it: rendered by the chat template with a marker where each
image goes, then tokenized piece by piece with each marker replaced by the image's tokens (the
model's image-start tokens, one placeholder per embedding row, its image-end tokens) and the
positions its rows fill (:class:`superfluid.core.media.MediaSpan`).

Where an image goes is the template's to say when it can: a template that loops over typed
parts and writes a placeholder of its own for a ``{"type": "image"}`` part (probed once,
:func:`superfluid.core.formats.template_messages.content_caps`: Mistral's ``[IMG]``, Gemma 4's
``<|image|>``, SmolVLM's ``<image>``) is given typed parts, and the k-th placeholder in what it
renders becomes the k-th image's marker, so the image's tokens (the engine's own layout) stand
exactly where the template puts its image. The same characters in a message's text reach the
template escaped and come back as text. A template that writes nothing distinguishable for an
image (or renders the placeholders a different number of times than there are images, e.g. one
that drops a message) gets the conversation's text with the markers where the images were, as
llama-server joins a message's parts around its media marker.

A marker is a private-use character pair around the image's number, which no chat template
writes and which tokenizes to nothing the template could split. A rendered prompt whose markers
do not name each image exactly once (a template that drops a message, or user text that holds
the reserved characters) is refused rather than guessed at."""

from __future__ import annotations

import hashlib
import re
from typing import Callable

from superfluid.core.errors import InvalidRequest
from superfluid.core.formats.template_messages import ContentCaps
from superfluid.core.media import Image, MediaSpan, VisionInfo

from ..content import ImagePart

_OPEN, _CLOSE = "\ue000", "\ue001"
_MARKER = re.compile(f"{_OPEN}(\\d+){_CLOSE}")


def marker(number: int) -> str:
    """The text that stands for the conversation's image ``number`` until the prompt is tokenized."""
    return f"{_OPEN}{number}{_CLOSE}"


def render_images(render: Callable[[bool], str], content: ContentCaps, count: int) -> str:
    """The prompt ``render(typed_images)`` gives, with ``count`` images' markers in it: at the
    template's own placeholders when it places typed image parts, else as rendered from text."""
    if count and content.typed_images:
        pieces = render(True).split(content.image)
        if len(pieces) == count + 1:
            return "".join(content.show(piece) + (marker(k) if k < count else "") for k, piece in enumerate(pieces))
    return render(False)


def stand_in(part: ImagePart, vision: VisionInfo) -> tuple[Image, tuple[int, int]]:
    """An image not loaded yet (a prompt only being counted) and the size the front end would fit
    it to, which decides its tiles: read from the image's header when the part carries its bytes
    (a data: URL; nothing is decoded), so the count is exact. A remote URL is not fetched to be
    counted: it counts as a square image, the most tiles any image gets. Its content is named by
    its URL."""
    image = Image(width=0, height=0, pixels=b"", digest=hashlib.sha256(part.url.encode()).hexdigest())
    size = _header_size(part.url)
    return image, vision.fit(*size) if size is not None else vision.fit(1, 1)


def _header_size(url: str) -> tuple[int, int] | None:
    """(width, height) from the header of a ``data:`` URL's image, None when it cannot be read."""
    import base64
    import io
    import warnings

    head, sep, payload = url.partition(",")
    if not (url.startswith("data:") and sep and head.endswith(";base64")):
        return None
    try:
        from PIL import Image as PILImage

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a bomb's size is only read here; loading it is refused
            with PILImage.open(io.BytesIO(base64.b64decode(payload, validate=True))) as img:
                width, height = img.size
    except Exception:  # noqa: BLE001 - anything unreadable counts as the square it may be
        return None
    return (width, height) if width > 0 and height > 0 else None


def tokenize_with_images(runtime, text: str, images: list[ImagePart], first_tokens) -> tuple[list[int], tuple[MediaSpan, ...]]:
    """(tokens, spans) of a rendered prompt holding image markers, each image laid out as the
    model's processor lays it out (:meth:`superfluid.core.media.VisionInfo.place`: its tiles and
    global image, one span each). ``first_tokens`` tokenizes the text before the first image (it
    decides on BOS); the rest is tokenized without special tokens added."""
    vision = runtime.engine.info.vision
    pieces = _MARKER.split(text)
    before, after = vision.text_around  # text the processor writes around the image tokens (Gemma 3)
    if before or after:  # tokenized with the text beside it, as the processor's expanded prompt is
        for k in range(0, len(pieces), 2):
            pieces[k] = (after if k else "") + pieces[k] + (before if k + 1 < len(pieces) else "")
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
        image, size = (part.image, None) if part.image is not None else stand_in(part, vision)
        laid, placed = vision.place(image, len(tokens), size)
        spans.extend(placed)
        tokens += laid
        if piece:
            tokens += runtime.engine.tokenize(piece, add_special=False, parse_special=True)
    if len(seen) != len(images):
        raise InvalidRequest(f"the model's chat template left out {len(images) - len(seen)} of the "
                             f"{len(images)} images", param="messages", code="invalid_value")
    return tokens, tuple(spans)
