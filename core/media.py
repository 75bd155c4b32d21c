"""Media in a prompt: images as values, the prompt positions they fill, and what engines share to
turn them into embedding rows.

An image is decoded, checked and resized at the edge (the front end) as the model's image
processor resizes it (:mod:`.image_tiles`: aspect ratio kept, longest edge to the processor's),
so every engine receives the same RGB pixels. The model's encoder turns it into embedding rows:
for a model that splits images (Idefics3 / SmolVLM), one block of rows per tile, then one for
the global image. In the prompt those blocks sit between the model's own tokens (a tile's
``<fake_token_around_image><row_1_col_2>``, a newline after a row of tiles, the global image's
``<fake_token_around_image><global-img>``), so an image fills several *spans*, each a run of
positions holding a block of its rows (:class:`MediaSpan`: where in the prompt, and from which
of the image's rows). The prompt's token list holds a *placeholder* at every row position: a
negative id (no vocabulary id is negative) derived from the image's content hash. So everything
that compares prompts by their tokens (the prefix cache, the host tier, waiting for a donor, the
block hashes that name KV pages and KV events) keys an image's spans by its content for free: a
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

from .anyres import AnyRes
from .image_tiles import Tiling
from .smart_resize import SmartResize


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
    """Prompt positions ``start`` … ``start + rows - 1`` hold ``image``'s embedding rows
    ``offset`` … ``offset + rows - 1`` (its encoder's rows, all tiles then the global image), in
    order. One image fills one span per tile; fields added later (positions for M-RoPE, …) take
    defaults, so a span written without them stays what it was."""

    image: Image
    start: int
    rows: int
    offset: int = 0
    # (nx, ny): the merged patch grid of an image whose rows take 2-D positions (M-RoPE: Qwen-VL);
    # None: one position a row
    grid: tuple[int, int] | None = None

    def __attrs_post_init__(self):
        if self.grid is not None and self.grid[0] * self.grid[1] != self.rows:
            raise ValueError(f"a {self.grid[0]}x{self.grid[1]} grid is not {self.rows} rows")

    @property
    def end(self) -> int:
        return self.start + self.rows

    @property
    def n_pos(self) -> int:
        """Positions the span takes in the model's sequence: the next token goes this far past
        its start (M-RoPE: the grid's longer side; else one a row)."""
        return max(self.grid) if self.grid is not None else self.rows

    def overlaps(self, start: int, end: int) -> bool:
        return self.start < end and start < self.end


def span_at(spans: Sequence[MediaSpan], pos: int) -> MediaSpan:
    """The span holding prompt position ``pos`` (a placeholder's position)."""
    for span in spans:
        if span.start <= pos < span.end:
            return span
    raise LookupError(f"no image fills prompt position {pos}")


def snap(spans: Sequence[MediaSpan], n: int) -> int:
    """``n``, or the start of the span ``n`` falls inside: the longest prefix of at most ``n``
    tokens that holds every image whole. A KV can only be cut there under M-RoPE (an image's
    cells share one position) and, with non-causal image attention, only there is it what a
    whole prompt would have computed (rows before a cut saw rows after it)."""
    for span in spans:
        if span.start < n < span.end:
            return span.start
    return n


def whole_chunk(spans: Sequence[MediaSpan], start: int, n: int) -> int:
    """A prefill chunk of ``n`` tokens from ``start``, made longer where it would end inside a
    span so every image goes whole (an image step needs all of it; a cut inside it is no cut)."""
    end = start + n
    for span in spans:
        if span.start < end < span.end:
            return span.end - start
    return n


def grids(spans: Sequence[MediaSpan]) -> tuple[tuple[int, int, int], ...]:
    """``(start, nx, ny)`` of every span with a 2-D grid: what an M-RoPE engine needs to place
    a lane's tokens (its next position is not its token count past such an image)."""
    return tuple((s.start, s.grid[0], s.grid[1]) for s in spans if s.grid is not None)


def spans_within(spans: Sequence[MediaSpan], start: int, end: int) -> tuple[MediaSpan, ...]:
    """The spans that positions ``start`` … ``end - 1`` touch."""
    return tuple(s for s in spans if s.overlaps(start, end))


def images_of(spans: Sequence[MediaSpan]) -> tuple[Image, ...]:
    """The distinct images the spans hold, in the order they first appear (an image that fills
    several spans counts once)."""
    seen: dict[str, Image] = {}
    for span in spans:
        seen.setdefault(span.image.digest, span.image)
    return tuple(seen.values())


@attrs.define(frozen=True)
class TileTokens:
    """The tokens around an image's tiles (Idefics3 / SmolVLM, as its processor writes them):
    ``opens[r][c]`` before tile (r, c) (``<fake_token_around_image><row_{r+1}_col_{c+1}>``),
    ``row_end`` after every row of tiles but the last, and ``global_open`` before the global
    image that follows the tiles (the last row's newline and the global image's own
    ``\n<fake_token_around_image><global-img>``, which tokenize together: ``\n\n`` is one token
    in SmolVLM's vocabulary, as llama.cpp's mtmd lays it out)."""

    opens: tuple[tuple[tuple[int, ...], ...], ...]
    row_end: tuple[int, ...]
    global_open: tuple[int, ...]


@attrs.define(frozen=True)
class VisionInfo:
    """How a model that takes images lays one out in a prompt, as its engine read it from the
    model's files. A tile of ``tile`` × ``tile`` pixels fills ``rows`` embedding rows. An image
    not split (or a model that never splits) is its global image alone, its rows between the
    tokens ``before`` and ``after`` (SmolVLM: ``<fake_token_around_image><global-img>`` …
    ``<fake_token_around_image>``). ``tiling`` (the processor's settings) says how the front end
    resizes an image and how many tiles it gives; ``tile_tokens`` the tokens around the tiles.
    Without ``tiling`` an image is squeezed to one tile. ``family`` names the layout, for logs
    and /health."""

    tile: int
    rows: int
    before: tuple[int, ...] = ()
    after: tuple[int, ...] = ()
    family: str = ""
    tiling: Tiling | None = None
    tile_tokens: TileTokens | None = None
    # Pillow's filter for an image not split (None: bicubic); Gemma 3's processor stretches bilinear
    resample: int | None = None
    # text the processor writes each side of the image's tokens, tokenized with the prompt's text
    # around it (Gemma 3: a blank line each side of <start_of_image> … <end_of_image>)
    text_around: tuple[str, str] = ("", "")
    # Qwen-VL: the image is resized to the processor's smart size and fills one span of
    # nx × ny rows on a 2-D grid (M-RoPE positions); ``tile`` and ``rows`` are then unused
    smart_resize: SmartResize | None = None
    # LLaVA-NeXT: the image reaches the engine as sent (its tiles, base image and unpadded grid
    # all follow from its own size) and fills one span of ``anyres.image_rows`` rows: the
    # processor writes nothing between the base image's rows and the grid's
    anyres: AnyRes | None = None

    def fit(self, width: int, height: int) -> tuple[int, int]:
        """The size the front end resizes a ``width × height`` image to."""
        if self.smart_resize is not None:
            return self.smart_resize.size(width, height)
        if self.anyres is not None:
            return width, height
        return self.tiling.resized(width, height) if self.tiling is not None else (self.tile, self.tile)

    def grid(self, width: int, height: int) -> tuple[int, int]:
        """(rows, cols) of tiles an image of that (already fitted) size fills; (0, 0): its global
        image alone."""
        if self.tiling is None or self.tile_tokens is None:
            return 0, 0
        return self.tiling.grid(width, height)

    def image_rows(self, width: int, height: int) -> int:
        """Embedding rows an image of that (fitted) size gives: every tile's and the global's."""
        if self.smart_resize is not None:
            nx, ny = self.smart_resize.grid(width, height)
            return nx * ny
        if self.anyres is not None:
            return self.anyres.image_rows(width, height)
        r, c = self.grid(width, height)
        return (r * c + 1) * self.rows

    def place(self, image: Image, start: int, size: tuple[int, int] | None = None
              ) -> tuple[list[int], tuple[MediaSpan, ...]]:
        """(the tokens ``image`` contributes to a prompt, placeholders included; the spans its
        rows fill) for the image placed at prompt position ``start``. ``size``: the fitted size,
        for an image whose pixels are not loaded (a prompt only being counted)."""
        width, height = size if size is not None else (image.width, image.height)
        hole = placeholder(image.digest)
        if self.smart_resize is not None:  # one span on the merged patch grid
            nx, ny = self.smart_resize.grid(width, height)
            span = MediaSpan(image=image, start=start + len(self.before), rows=nx * ny, grid=(nx, ny))
            return [*self.before, *[hole] * span.rows, *self.after], (span,)
        if self.anyres is not None:  # one span: base image, then the grid's rows with their newlines
            span = MediaSpan(image=image, start=start + len(self.before), rows=self.anyres.image_rows(width, height))
            return [*self.before, *[hole] * span.rows, *self.after], (span,)
        n_rows, n_cols = self.grid(width, height)
        tokens: list[int] = []
        spans: list[MediaSpan] = []

        def rows(k: int) -> None:  # the k-th tile's block (the global image's is the last)
            spans.append(MediaSpan(image=image, start=start + len(tokens), rows=self.rows, offset=k * self.rows))
            tokens.extend([hole] * self.rows)

        if n_rows == 0:
            tokens.extend(self.before)
            rows(0)
        else:
            tt = self.tile_tokens
            for r in range(n_rows):
                if r:
                    tokens.extend(tt.row_end)
                for c in range(n_cols):
                    tokens.extend(tt.opens[r][c])
                    rows(r * n_cols + c)
            tokens.extend(tt.global_open)
            rows(n_rows * n_cols)
        tokens.extend(self.after)
        return tokens, tuple(spans)

    def prompt_tokens(self, image: Image, size: tuple[int, int] | None = None) -> list[int]:
        """The tokens an image contributes to a prompt, placeholders included."""
        return self.place(image, 0, size)[0]


def idefics3_layout(image_size: int, patch_size: int, scale_factor: int,
                    token_id: Callable[[str], int | None], tiling: Tiling | None = None) -> VisionInfo:
    """SmolVLM / Idefics3: tiles of ``image_size`` pixels in patches of ``patch_size``, pixel
    shuffled by ``scale_factor``, split as ``tiling`` says (None: squeezed to one global image),
    wrapped in SmolVLM's image tokens. ``token_id`` maps a token's text to its id (None: not
    one token of the vocabulary)."""
    side = image_size // patch_size
    rows = side * side // (scale_factor * scale_factor)
    names = ["<fake_token_around_image>", "<global-img>"]
    n = tiling.max_side if tiling is not None else 0
    names += [f"<row_{r + 1}_col_{c + 1}>" for r in range(n) for c in range(n)]
    ids = {name: token_id(name) for name in names}
    missing = [name for name, i in ids.items() if i is None]
    if missing:
        raise ValueError(f"the vocabulary lacks SmolVLM's image tokens {missing}")
    around, glob = ids["<fake_token_around_image>"], ids["<global-img>"]
    tile_tokens = None
    if n:
        newline = token_id("\n")
        if newline is None:
            raise ValueError("the vocabulary has no newline token, which SmolVLM's tiles need")
        double = token_id("\n\n")
        tile_tokens = TileTokens(
            opens=tuple(tuple((around, ids[f"<row_{r + 1}_col_{c + 1}>"]) for c in range(n)) for r in range(n)),
            row_end=(newline,),
            global_open=((double,) if double is not None else (newline, newline)) + (around, glob))
    return VisionInfo(tile=image_size, rows=rows, before=(around, glob), after=(around,), family="idefics3",
                      tiling=tiling, tile_tokens=tile_tokens)


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
        placeholders (of one span or several in a row: tiles of one image, images side by
        side)."""
        out = []
        while count > 0:
            span = span_at(spans, pos)
            take = min(count, span.end - pos)
            first = span.offset + pos - span.start
            out.append(self.rows(span.image)[first:first + take])
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
