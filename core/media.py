"""Media in a prompt: images as values, the prompt positions they fill, and what engines share to
turn them into embedding rows.

An image is decoded, checked and resized to the model's tile at the edge (the front end), so
every engine receives the same RGB pixels. In the prompt it fills ``rows`` positions, one per
embedding row its encoder gives; the prompt's token list holds a *placeholder* there: a negative
id (no vocabulary id is negative) derived from the image's content hash. So everything that
compares prompts by their tokens (the prefix cache, the host tier, waiting for a donor, the
block hashes that name KV pages and KV events) keys an image span by its content for free: a
second request with the same image and text reuses the KV past the image, and a different image
diverges where it starts.

Engines meet placeholders only in a lane's feed. ``LanePlan.media`` then names the spans the feed
touches, and the engine feeds the image's embedding rows there instead of token embeddings,
encoding each image once (:class:`EncoderCache`, keyed by the content hash)."""

from __future__ import annotations

import hashlib
import os
from collections import OrderedDict
from typing import Callable, Sequence

import attrs
import numpy as np


@attrs.define(frozen=True)
class Image:
    """An image as engines take it: ``width`` × ``height`` RGB pixels, row-major, 3 bytes each.
    ``digest`` (SHA-256 of the size and the pixels) names its content."""

    width: int
    height: int
    pixels: bytes = attrs.field(repr=False)
    digest: str

    @classmethod
    def from_rgb(cls, width: int, height: int, pixels: bytes) -> "Image":
        if len(pixels) != width * height * 3:
            raise ValueError(f"{len(pixels)} bytes are not {width}x{height} RGB pixels")
        h = hashlib.sha256(f"{width}x{height}:".encode())
        h.update(pixels)
        return cls(width=width, height=height, pixels=bytes(pixels), digest=h.hexdigest())

    def array(self) -> np.ndarray:
        """The pixels as a ``height × width × 3`` uint8 array."""
        return np.frombuffer(self.pixels, dtype=np.uint8).reshape(self.height, self.width, 3)

    def normalised(self, mean: Sequence[float], std: Sequence[float]) -> np.ndarray:
        """The pixels as a ``3 × height × width`` float32 array, each channel scaled to [0, 1] and
        then standardised with the vision tower's mean and standard deviation."""
        x = self.array().astype(np.float32) / 255.0
        x = (x - np.asarray(mean, dtype=np.float32)) / np.asarray(std, dtype=np.float32)
        return np.ascontiguousarray(x.transpose(2, 0, 1))


def placeholder(digest: str) -> int:
    """The token id that stands for every row of the image with content hash ``digest`` in a
    prompt: negative, and the same for the same content (60 bits of the hash)."""
    return -1 - int(digest[:15], 16)


def is_placeholder(token: int) -> bool:
    return token < 0


@attrs.define(frozen=True)
class MediaSpan:
    """Prompt positions ``start`` … ``start + rows - 1`` hold ``image``'s embedding rows, in
    order."""

    image: Image
    start: int
    rows: int

    @property
    def end(self) -> int:
        return self.start + self.rows

    def overlaps(self, start: int, end: int) -> bool:
        return self.start < end and start < self.end


def span_at(spans: Sequence[MediaSpan], pos: int) -> MediaSpan:
    """The span holding prompt position ``pos`` (a placeholder's position)."""
    for span in spans:
        if span.start <= pos < span.end:
            return span
    raise LookupError(f"no image fills prompt position {pos}")


def spans_within(spans: Sequence[MediaSpan], start: int, end: int) -> tuple[MediaSpan, ...]:
    """The spans that positions ``start`` … ``end - 1`` touch."""
    return tuple(s for s in spans if s.overlaps(start, end))


@attrs.define(frozen=True)
class VisionInfo:
    """How a model that takes images lays one out in a prompt, as its engine read it from the
    model's files: the image resized to ``tile`` × ``tile`` pixels fills ``rows`` embedding rows,
    between the tokens ``before`` and ``after`` (SmolVLM: ``<fake_token_around_image><global-img>``
    … ``<fake_token_around_image>``). ``family`` names the layout, for logs and /health."""

    tile: int
    rows: int
    before: tuple[int, ...] = ()
    after: tuple[int, ...] = ()
    family: str = ""

    def prompt_tokens(self, image: Image) -> list[int]:
        """The tokens an image contributes to a prompt, placeholders included."""
        return [*self.before, *([placeholder(image.digest)] * self.rows), *self.after]


def idefics3_layout(image_size: int, patch_size: int, scale_factor: int,
                    token_id: Callable[[str], int | None]) -> VisionInfo:
    """SmolVLM / Idefics3: a tile of ``image_size`` pixels in patches of ``patch_size``, pixel
    shuffled by ``scale_factor``, one global image (no sub-image tiles), wrapped in SmolVLM's
    image tokens. ``token_id`` maps a token's text to its id (None: not in the vocabulary)."""
    side = image_size // patch_size
    rows = side * side // (scale_factor * scale_factor)
    ids = {name: token_id(name) for name in ("<fake_token_around_image>", "<global-img>")}
    missing = [name for name, i in ids.items() if i is None]
    if missing:
        raise ValueError(f"the vocabulary lacks SmolVLM's image tokens {missing}")
    around, glob = ids["<fake_token_around_image>"], ids["<global-img>"]
    return VisionInfo(tile=image_size, rows=rows, before=(around, glob), after=(around,), family="idefics3")


class EncoderCache:
    """Embedding rows of encoded images by content hash, least recently used first out, within
    ``max_bytes``. An engine asks :meth:`rows` for an image's rows; the encoder runs only for an
    image it does not hold (``encodes`` counts those runs)."""

    def __init__(self, encode: Callable[[Image], np.ndarray], max_bytes: int = 256 << 20):
        self._encode = encode
        self.max_bytes = max_bytes
        self._rows: OrderedDict[str, np.ndarray] = OrderedDict()
        self._bytes = 0
        self.encodes = 0

    def rows(self, image: Image) -> np.ndarray:
        got = self._rows.get(image.digest)
        if got is not None:
            self._rows.move_to_end(image.digest)
            return got
        got = np.ascontiguousarray(self._encode(image), dtype=np.float32)
        self.encodes += 1
        self._rows[image.digest] = got
        self._bytes += got.nbytes
        while self._bytes > self.max_bytes and len(self._rows) > 1:
            _, old = self._rows.popitem(last=False)
            self._bytes -= old.nbytes
        return got

    def row_block(self, spans: Sequence[MediaSpan], pos: int, count: int) -> np.ndarray:
        """The embedding rows for prompt positions ``pos`` … ``pos + count - 1``, all
        placeholders (of one image or several in a row)."""
        out = []
        while count > 0:
            span = span_at(spans, pos)
            take = min(count, span.end - pos)
            out.append(self.rows(span.image)[pos - span.start:pos - span.start + take])
            pos += take
            count -= take
        return np.concatenate(out) if len(out) > 1 else out[0]


def leading_placeholders(feed: Sequence[int]) -> int:
    """How many of a feed's first tokens are placeholders (image rows)."""
    n = 0
    for t in feed:
        if t >= 0:
            break
        n += 1
    return n


def leading_tokens(feed: Sequence[int]) -> int:
    """How many of a feed's first tokens are real tokens (before any image row)."""
    n = 0
    for t in feed:
        if t < 0:
            break
        n += 1
    return n


def find_mmproj(model_path: str, configured: str | None) -> str | None:
    """The vision half of a GGUF model: ``configured`` (the model's ``mmproj`` option), else the
    one ``mmproj*.gguf`` beside the model file; None for a text-only model. A configured file
    that is missing, or several candidates beside the model, are errors."""
    if configured:
        if not os.path.isfile(configured):
            raise FileNotFoundError(f"mmproj file not found: {configured}")
        return configured
    folder = os.path.dirname(os.path.abspath(model_path))
    found = sorted(f for f in os.listdir(folder) if f.lower().startswith("mmproj") and f.lower().endswith(".gguf"))
    if len(found) > 1:
        raise FileExistsError(f"several mmproj files beside {model_path} ({', '.join(found)}): set mmproj to one")
    return os.path.join(folder, found[0]) if found else None
