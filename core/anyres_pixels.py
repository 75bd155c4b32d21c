"""LLaVA-NeXT's pixels: an image cut into the crops its processor feeds the vision tower, the rule
of transformers' ``LlavaNextImageProcessor`` (its PIL backend), kept here beside the layout
(:mod:`.anyres`) so every engine feeds the tower the same pixels.

The processor works from the image as sent, so the front end leaves it at its own size
(``VisionInfo.fit``): the base image and the crops both come from the original pixels, and the
unpadding needs the original aspect ratio. In order, as uint8 RGB:

1. the base image: the whole image resized to ``tile × tile`` (aspect not kept), bicubic;
2. the image resized to fit its best pinpoint keeping its aspect (the short side rounded up,
   transformers' ``get_patch_output_size``), bicubic, centred on black (zero) padding to the
   pinpoint, then cut into ``tile × tile`` crops row-major.

The processor's later resize (shortest edge to the tile) and centre crop leave tile-sized crops
as they are; rescaling and normalising are the tower's (:func:`.image_tiles.normalise`)."""

from __future__ import annotations

import math

import numpy as np

from .anyres import AnyRes
from .image_tiles import BICUBIC
from .media import Image


def fitted_size(width: int, height: int, target: tuple[int, int]) -> tuple[int, int]:
    """(w, h) an image of ``width × height`` is resized to inside ``target`` ``(W, H)``, aspect
    kept, the scaled side rounded up (at most the target's)."""
    tw, th = target
    sw, sh = tw / width, th / height
    if sw < sh:
        return tw, min(math.ceil(height * sw), th)
    return min(math.ceil(width * sh), tw), th


def crops(image: Image, rule: AnyRes) -> np.ndarray:
    """The base image then the crops, ``n × tile × tile × 3`` uint8, as the processor cuts them."""
    from PIL import Image as PILImage

    pil = PILImage.fromarray(image.array())
    tile = rule.tile
    base = np.asarray(pil.resize((tile, tile), BICUBIC))
    res_w, res_h = rule.best_resolution(image.width, image.height)
    w, h = fitted_size(image.width, image.height, (res_w, res_h))
    resized = np.asarray(pil.resize((w, h), BICUBIC)) if (w, h) != (image.width, image.height) else image.array()
    padded = np.zeros((res_h, res_w, 3), dtype=np.uint8)
    top, left = (res_h - h) // 2, (res_w - w) // 2
    padded[top:top + h, left:left + w] = resized
    out = [base]
    for y in range(0, res_h, tile):
        for x in range(0, res_w, tile):
            out.append(padded[y:y + tile, x:x + tile])
    return np.stack(out)
