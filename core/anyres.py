"""How LLaVA-NeXT's "anyres" processor lays out an image, and so how many ``<image>`` rows it
becomes: the rule of transformers' ``LlavaNextProcessor`` / ``LlavaNextImageProcessor``, kept here
once so the prompt layout (which counts rows) and the engines (which must produce as many
embeddings) agree.

An image of ``w × h`` pixels is fitted into the best of the model's ``image_grid_pinpoints`` (the
resolution that keeps the most of the image's pixels and, among equals, wastes the fewest: the
processor's ``select_best_resolution``), padded to it and cut into ``tile × tile`` crops, the
vision tower's own size (336 px for LLaVA-NeXT-7B); the whole image, resized to one tile, goes
first (the *base* image). Each crop is ``tile / patch`` patches a side.

The embeddings are the base image's patches (``(tile / patch)²``; a CLS feature too when
``vision_feature_select_strategy`` is ``"full"``), then the crops' patch grid stitched into one
feature map, with the rows or columns that cover only padding cut away (``unpad_image``), and
one learned ``image_newline`` row after each feature row: ``rows × (cols + 1)``.

Sizes are ``(width, height)`` here, as the rest of the daemon writes them; transformers writes
``(height, width)``, pinpoints included: :meth:`AnyRes.from_config` turns them.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

import attrs

# LLaVA-NeXT-7B's (llava-v1.6-*) pinpoints, (width, height)
LLAVA_NEXT_PINPOINTS = ((672, 336), (336, 672), (672, 672), (336, 1008), (1008, 336))


@attrs.define(frozen=True)
class AnyResGrid:
    """One image's layout: ``resolution`` the pinpoint it was fitted into, ``tiles`` its crops
    ``(across, down)``, ``base`` the base image's rows, ``grid`` the unpadded feature map
    ``(cols, rows)``; ``rows`` in all, newlines included."""

    resolution: tuple[int, int]
    tiles: tuple[int, int]
    base: int
    grid: tuple[int, int]

    @property
    def rows(self) -> int:
        cols, rows = self.grid
        return self.base + rows * (cols + 1)


@attrs.define(frozen=True)
class AnyRes:
    """The processor's settings: ``tile`` pixels a crop (the tower's ``image_size``), ``patch``
    pixels a patch, ``pinpoints`` the resolutions ``(width, height)`` an image may be fitted into,
    ``strategy`` the ``vision_feature_select_strategy`` (``"default"`` drops the tower's CLS
    feature, ``"full"`` keeps it) and ``extra`` the tower's features beyond its patches (1 for
    CLIP's CLS, 0 for SigLIP)."""

    tile: int = 336
    patch: int = 14
    pinpoints: tuple[tuple[int, int], ...] = LLAVA_NEXT_PINPOINTS
    strategy: str = "default"
    extra: int = 1

    def __attrs_post_init__(self) -> None:
        if self.strategy not in ("default", "full"):
            raise ValueError(f"unknown vision_feature_select_strategy {self.strategy!r} (default or full)")
        if not self.pinpoints:
            raise ValueError("anyres needs at least one image_grid_pinpoints resolution")
        for w, h in self.pinpoints:
            if w % self.tile or h % self.tile:
                raise ValueError(f"pinpoint {w}x{h} is not whole {self.tile}-pixel tiles")

    @classmethod
    def from_config(cls, pinpoints: Iterable[Iterable[int]], *, tile: int, patch: int,
                    strategy: str = "default", extra: int = 1) -> "AnyRes":
        """From transformers' ``image_grid_pinpoints`` (``[height, width]`` pairs)."""
        return cls(tile=int(tile), patch=int(patch), pinpoints=tuple((int(w), int(h)) for h, w in pinpoints),
                   strategy=strategy, extra=int(extra))

    @classmethod
    def from_hf_config(cls, cfg: Mapping[str, Any]) -> "AnyRes":
        """From a LLaVA-NeXT ``config.json`` (a dict): its pinpoints, tower and strategy. A tower
        with a CLS feature (CLIP) has one extra feature; SigLIP has none."""
        vision = cfg.get("vision_config") or {}
        extra = 0 if "siglip" in str(vision.get("model_type", "clip_vision_model")) else 1
        return cls.from_config(cfg["image_grid_pinpoints"], tile=vision.get("image_size", 336),
                               patch=vision.get("patch_size", 14),
                               strategy=cfg.get("vision_feature_select_strategy", "default"), extra=extra)

    @property
    def side(self) -> int:
        """Patches along a tile's side."""
        return self.tile // self.patch

    def best_resolution(self, width: int, height: int) -> tuple[int, int]:
        """The pinpoint ``(W, H)`` a ``width × height`` image is fitted into: the most of its
        pixels kept after scaling it to fit, then the fewest wasted (the first among equals)."""
        if width <= 0 or height <= 0:
            raise ValueError(f"an image of {width}x{height} pixels has no area")
        best, kept_most, wasted_least = None, 0, float("inf")
        for w, h in self.pinpoints:
            scale = min(w / width, h / height)
            kept = min(int(width * scale) * int(height * scale), width * height)
            wasted = w * h - kept
            if kept > kept_most or (kept == kept_most and wasted < wasted_least):
                best, kept_most, wasted_least = (w, h), kept, wasted
        assert best is not None
        return best

    def layout(self, width: int, height: int) -> AnyResGrid:
        """The layout of a ``width × height`` image (its size before any resizing)."""
        res_w, res_h = self.best_resolution(width, height)
        tiles = (res_w // self.tile, res_h // self.tile)
        cols, rows = tiles[0] * self.side, tiles[1] * self.side
        # the image was scaled to fit and centred; the feature rows (or columns) that cover only
        # the padding are cut, with the processor's rounding (7 decimals, then down)
        if width / height > cols / rows:
            rows -= (rows - int(round(height * (cols / width), 7))) // 2 * 2
        else:
            cols -= (cols - int(round(width * (rows / height), 7))) // 2 * 2
        base = self.side * self.side + self.extra - (1 if self.strategy == "default" else 0)
        return AnyResGrid(resolution=(res_w, res_h), tiles=tiles, base=base, grid=(cols, rows))

    def image_rows(self, width: int, height: int) -> int:
        """How many ``<image>`` rows the processor writes for a ``width × height`` image."""
        return self.layout(width, height).rows
