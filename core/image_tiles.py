"""How a vision model's image processor sizes an image and cuts it into the tiles its tower
encodes: the rules of transformers' ``Idefics3ImageProcessor`` (SmolVLM), which llama.cpp's mtmd
follows too, kept here once so that the front end (which resizes), the prompt layout (which
counts tiles) and every engine's encoder (which cuts them) agree by construction.

For an image of ``w × h`` pixels, with the processor's ``size["longest_edge"]`` ``L`` and its
``max_image_size["longest_edge"]`` ``T`` (the tower's tile):

1. resize keeping the aspect ratio so the longest edge is ``L`` (up or down; the other edge
   truncated to an integer and rounded up to an even number; never past 4096). The front end
   does this, so the image an engine receives is already this size;
2. with splitting on: resize (aspect ratio not kept) to whole tiles: the longest edge up to a
   multiple of ``T``, the other edge to what the aspect ratio gives it, up to a multiple of ``T``;
   an image of more than one tile is cut into ``rows × cols`` tiles, row-major, and followed by
   the whole of it resized to one tile (the *global image*); an image of one tile is its global
   image alone;
3. with splitting off: the global image alone (the image squeezed to ``T × T``).

The tiles and the global image are then rescaled to [0, 1] and standardised
(:meth:`superfluid.core.media.Image.normalised` does that for one tile's pixels). Resizing is
Pillow's, with the processor's filter (Lanczos for Idefics3), on 8-bit RGB, as transformers'
Pillow backend resizes; llama.cpp's mtmd reimplements Pillow's filters the same way."""

from __future__ import annotations

import json
import math
import os
from typing import TYPE_CHECKING, Any, Mapping

import attrs
import numpy as np

if TYPE_CHECKING:
    from .media import Image

#: Pillow's (and transformers' ``PILImageResampling``) numbers for the filters
NEAREST, LANCZOS, BILINEAR, BICUBIC = 0, 1, 2, 3
#: transformers' absolute bound on an image's longest edge after the first resize
MAX_EDGE = 4096


def keep_aspect(width: int, height: int, longest_edge: int) -> tuple[int, int]:
    """(width, height) of an image resized so its longest edge is ``longest_edge``, the other
    edge following the aspect ratio (truncated, then made even), bounded by :data:`MAX_EDGE`."""
    aspect = width / height
    if width >= height:
        w = longest_edge
        h = int(w / aspect)
        h += h % 2
    else:
        h = longest_edge
        w = int(h * aspect)
        w += w % 2
    w, h = max(w, 1), max(h, 1)
    aspect = w / h
    if w >= h and w > MAX_EDGE:
        w, h = MAX_EDGE, int(MAX_EDGE / aspect)
    elif h > w and h > MAX_EDGE:
        h, w = MAX_EDGE, int(MAX_EDGE * aspect)
    return max(w, 1), max(h, 1)


def whole_tiles(width: int, height: int, tile: int) -> tuple[int, int]:
    """(width, height) of an image resized to whole ``tile``-pixel tiles: the longest edge up to
    a multiple of the tile, the other one to what the aspect ratio gives it, then up too."""
    aspect = width / height
    if width >= height:
        w = math.ceil(width / tile) * tile
        h = math.ceil(int(w / aspect) / tile) * tile
    else:
        h = math.ceil(height / tile) * tile
        w = math.ceil(int(h * aspect) / tile) * tile
    return max(w, tile), max(h, tile)


@attrs.define(frozen=True)
class Tiling:
    """An image processor's settings (from the model's files: an HF directory's
    ``preprocessor_config.json``, an mmproj's ``clip.vision.*`` keys). ``tile``: the tower's
    input side; ``longest_edge``: the first resize's target; ``split``: tiles by aspect ratio
    (else the global image alone); ``resample``: Pillow's filter number."""

    tile: int
    longest_edge: int
    split: bool = True
    resample: int = LANCZOS

    def __attrs_post_init__(self) -> None:
        if self.tile <= 0 or self.longest_edge <= 0:
            raise ValueError(f"tile {self.tile} and longest edge {self.longest_edge} must be positive")

    @property
    def max_side(self) -> int:
        """The most tiles along one edge any image gets."""
        return math.ceil(min(self.longest_edge, MAX_EDGE) / self.tile) if self.split else 0

    def resized(self, width: int, height: int) -> tuple[int, int]:
        """The size the front end resizes a ``width × height`` image to (step 1)."""
        return keep_aspect(width, height, self.longest_edge)

    def grid(self, width: int, height: int) -> tuple[int, int]:
        """(rows, cols) of tiles for an image already at :meth:`resized`'s size; (0, 0): the
        global image alone."""
        if not self.split:
            return 0, 0
        w, h = whole_tiles(width, height, self.tile)
        if w > self.tile or h > self.tile:
            return h // self.tile, w // self.tile
        return 0, 0

    def count(self, width: int, height: int) -> int:
        """How many tiles the tower encodes for the image, the global image included."""
        rows, cols = self.grid(width, height)
        return rows * cols + 1

    def tiles(self, image: "Image") -> np.ndarray:
        """The image's tiles then its global image, ``n × tile × tile × 3`` uint8, cut and resized
        as the processor does (the image is already at :meth:`resized`'s size)."""
        from PIL import Image as PILImage

        t = self.tile
        img = PILImage.frombytes("RGB", (image.width, image.height), image.pixels)
        rows, cols = self.grid(image.width, image.height)
        if rows == 0:
            if self.split:  # one tile: the whole-tiles resize is the global image
                return np.asarray(img.resize(whole_tiles(image.width, image.height, t), self.resample))[None]
            return np.asarray(img.resize((t, t), self.resample))[None]
        whole = img.resize((cols * t, rows * t), self.resample)
        arr = np.asarray(whole)
        out = [arr[r * t:(r + 1) * t, c * t:(c + 1) * t] for r in range(rows) for c in range(cols)]
        out.append(np.asarray(whole.resize((t, t), self.resample)))
        return np.stack(out)


def normalise(tiles: np.ndarray, mean, std) -> np.ndarray:
    """``n × h × w × 3`` uint8 tiles as the tower takes them: ``n × 3 × h × w`` float32, each
    channel scaled to [0, 1] and standardised with the processor's mean and standard deviation
    (the same arithmetic as :meth:`superfluid.core.media.Image.normalised`)."""
    x = tiles.astype(np.float32) / 255.0
    x = (x - np.asarray(mean, dtype=np.float32)) / np.asarray(std, dtype=np.float32)
    return np.ascontiguousarray(x.transpose(0, 3, 1, 2))


def read_preprocessor(path: str) -> dict[str, Any] | None:
    """An HF directory's image processor settings: its ``preprocessor_config.json`` (as SmolVLM
    publishes it), else the ``image_processor`` transformers 5 nests in ``processor_config.json``;
    None when it has neither."""
    for name, key in (("preprocessor_config.json", None), ("processor_config.json", "image_processor")):
        try:
            with open(os.path.join(path, name)) as fh:
                config = json.load(fh)
        except (OSError, ValueError):
            continue
        found = config.get(key) if key else config
        if isinstance(found, dict):
            return found
    return None


def from_preprocessor(config: Mapping[str, Any], tile: int) -> Tiling:
    """The tiling an HF directory's ``preprocessor_config.json`` (parsed) describes, for a tower
    of ``tile`` pixels; ValueError for settings this code does not reproduce."""
    max_size = (config.get("max_image_size") or {}).get("longest_edge", tile)
    if int(max_size) != tile:
        raise ValueError(f"the processor's tiles are {max_size} pixels, the vision tower's {tile}")
    if config.get("do_resize") is False:
        raise ValueError("the processor does not resize (do_resize false), which is not served")
    size = config.get("size") or {}
    if "longest_edge" not in size:
        raise ValueError(f"the processor's size {dict(size)} has no longest_edge")
    if float(config.get("rescale_factor", 1 / 255)) != 1 / 255 or config.get("do_rescale") is False:
        raise ValueError("the processor rescales pixels other than by 1/255, which is not served")
    return Tiling(tile=tile, longest_edge=int(size["longest_edge"]), split=bool(config.get("do_image_splitting", True)),
                  resample=int(config.get("resample", LANCZOS)))


def from_mmproj(meta: Mapping[str, Any], tile: int) -> Tiling:
    """The tiling llama.cpp's mtmd applies for an Idefics3 mmproj (its metadata, ``clip.*``
    keys): it always splits, with Lanczos, to ``clip.vision.preproc_image_size`` (one tile when
    the file does not say)."""
    longest = meta.get("clip.vision.preproc_image_size")
    return Tiling(tile=tile, longest_edge=int(longest) if longest else tile, split=True, resample=LANCZOS)
