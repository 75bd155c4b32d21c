"""How Qwen-VL's image processor sizes an image, and so how many embedding rows it becomes: the
rule of transformers' ``smart_resize`` (Qwen2-VL, Qwen2.5-VL, Qwen3-VL), kept here once so the
front end (which resizes), the prompt layout (which counts rows and needs the merged grid for
M-RoPE positions) and the engines agree.

An image of ``w × h`` pixels is resized, keeping its aspect ratio as well as whole patches allow,
to ``W × H``, both multiples of ``factor = patch × merge`` (28 for Qwen2/2.5-VL, 32 for Qwen3-VL),
with ``min_pixels <= W × H <= max_pixels``. The tower cuts it into ``patch``-pixel patches and
merges ``merge × merge`` of them into one row: a grid of ``W / factor`` rows across and
``H / factor`` down, ``(W / factor) × (H / factor)`` rows in all.

libmtmd computes the same sizes (``calc_size_preserved_ratio``) with two differences, both of
which vanish when it is handed an image already at ``W × H`` (it then resizes nothing):

* it rounds a half up (C's ``round``) where Python rounds it to even: a 70-pixel side is 2.5
  merged patches, 84 pixels to libmtmd and 56 to transformers;
* its own pixel limits are 8 and 4096 rows (``set_limit_image_tokens``) unless the mtmd context
  is given others (``mtmd_context_params.image_min_tokens`` / ``image_max_tokens``):
  :func:`mtmd_token_limits` gives the ones that match the processor's.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import attrs


@attrs.define(frozen=True)
class SmartResize:
    """The processor's settings: ``patch`` pixels a patch, ``merge × merge`` patches a row,
    ``min_pixels`` … ``max_pixels`` pixels an image after resizing."""

    patch: int = 14
    merge: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 14 * 14 * 4 * 1280

    @property
    def factor(self) -> int:
        return self.patch * self.merge

    @classmethod
    def from_preprocessor(cls, cfg: Mapping[str, Any]) -> "SmartResize":
        """From a ``preprocessor_config.json`` (transformers 5 writes the pixel limits as
        ``size: {shortest_edge, longest_edge}``, older files as ``min_pixels`` / ``max_pixels``)."""
        size = cfg.get("size") or {}
        default = cls()
        return cls(patch=int(cfg.get("patch_size", default.patch)), merge=int(cfg.get("merge_size", default.merge)),
                   min_pixels=int(cfg.get("min_pixels") or size.get("shortest_edge") or default.min_pixels),
                   max_pixels=int(cfg.get("max_pixels") or size.get("longest_edge") or default.max_pixels))

    def size(self, width: int, height: int) -> tuple[int, int]:
        """The ``(W, H)`` the processor resizes a ``width × height`` image to."""
        if width <= 0 or height <= 0:
            raise ValueError(f"an image of {width}x{height} pixels has no area")
        if max(width, height) / min(width, height) > 200:
            raise ValueError(f"an image of {width}x{height} pixels is more than 200 times as long as it is wide")
        f = self.factor
        h_bar, w_bar = round(height / f) * f, round(width / f) * f
        if h_bar * w_bar > self.max_pixels:
            beta = math.sqrt(height * width / self.max_pixels)
            h_bar = max(f, math.floor(height / beta / f) * f)
            w_bar = max(f, math.floor(width / beta / f) * f)
        elif h_bar * w_bar < self.min_pixels:
            beta = math.sqrt(self.min_pixels / (height * width))
            h_bar = math.ceil(height * beta / f) * f
            w_bar = math.ceil(width * beta / f) * f
        return w_bar, h_bar

    def grid(self, width: int, height: int) -> tuple[int, int]:
        """The merged patch grid ``(nx, ny)`` (across, down) of a ``width × height`` image:
        ``nx * ny`` embedding rows, ``max(nx, ny)`` M-RoPE positions."""
        w, h = self.size(width, height)
        return w // self.factor, h // self.factor


def mtmd_token_limits(rule: SmartResize) -> tuple[int, int]:
    """``(image_min_tokens, image_max_tokens)`` for libmtmd's context so its pixel limits are the
    processor's (it multiplies them by ``factor²``)."""
    area = rule.factor * rule.factor
    return math.ceil(rule.min_pixels / area), rule.max_pixels // area
