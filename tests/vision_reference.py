"""The transformers reference for the tiny SmolVLM (tools/fixtures/tiny_vlm.py), computed in the test
process by transformers' own ``Idefics3Processor`` (the fixture's processor files: resize, tiles,
the prompt's image tokens) and ``Idefics3ForConditionalGeneration`` (its vision tower, connector
and ``generate``), so every engine is compared with an independent implementation of the whole
image path rather than with frozen strings or with our own layout."""

from __future__ import annotations

import functools
import io
from pathlib import Path
from typing import Sequence

import numpy as np

from superfluid.core.image_tiles import from_preprocessor, read_preprocessor
from superfluid.core.media import Image, MediaSpan, VisionInfo, idefics3_layout, images_of

MEAN = STD = (0.5, 0.5, 0.5)
WIDE, TALL = (200, 64), (64, 200)  # the aspect ratios the engines are checked at (2 x 4 and 4 x 2 tiles)


def solid(rgb: tuple[int, int, int], size: int | tuple[int, int] = 64) -> Image:
    """A one-colour image of ``size`` pixels a side (or ``(width, height)``)."""
    w, h = (size, size) if isinstance(size, int) else size
    return Image.from_rgb(w, h, bytes(rgb) * (w * h))


def noise(size: tuple[int, int], seed: int = 7) -> Image:
    """An image of random pixels (every resize filter shows in it)."""
    w, h = size
    return Image.from_rgb(w, h, np.random.default_rng(seed).integers(0, 256, w * h * 3, dtype=np.uint8).tobytes())


def pil(image: Image):
    from PIL import Image as PILImage

    return PILImage.frombytes("RGB", (image.width, image.height), image.pixels)


def png(rgb, size: int | tuple[int, int] = 64) -> bytes:
    """A one-colour PNG (or any :class:`Image`'s pixels as a PNG), as a client would send it."""
    buf = io.BytesIO()
    pil(rgb if isinstance(rgb, Image) else solid(rgb, size)).save(buf, format="PNG")
    return buf.getvalue()


@functools.cache
def _model(hf_dir: str):
    import torch
    from transformers import Idefics3ForConditionalGeneration

    torch.set_num_threads(2)
    return Idefics3ForConditionalGeneration.from_pretrained(hf_dir, dtype=torch.float32).eval()


@functools.cache
def processor(hf_dir: str):
    """transformers' ``Idefics3Processor`` (its Pillow image processor) from the fixture's own
    files, named rather than found through ``AutoProcessor``: mlx-vlm, once imported, registers a
    processor of its own for the model type."""
    from transformers import Idefics3ImageProcessorPil, Idefics3Processor
    from transformers.models.idefics3.processing_idefics3 import Idefics3Processor as Theirs

    proc = Idefics3Processor.from_pretrained(hf_dir, image_processor=Idefics3ImageProcessorPil.from_pretrained(hf_dir))
    assert type(proc) is Theirs and type(proc.image_processor) is Idefics3ImageProcessorPil
    return proc


def _tokenizer(hf_dir: str):
    return processor(str(hf_dir)).tokenizer


def layout(hf_dir: str | Path) -> VisionInfo:
    """Our layout (core/media.py) for the fixture, from its processor settings and tokenizer."""
    return _layout(str(hf_dir))


@functools.cache
def _layout(hf_dir: str) -> VisionInfo:
    tok = _tokenizer(hf_dir)

    def token_id(text: str) -> int | None:
        ids = tok.encode(text, add_special_tokens=False)
        return ids[0] if len(ids) == 1 else None

    return idefics3_layout(64, 16, 2, token_id, from_preprocessor(read_preprocessor(str(hf_dir)), 64))


def fit(hf_dir: str | Path, image: Image) -> Image:
    """The image as the front end hands it to an engine (plugins/http/images.py's ``decode`` of
    its PNG: resized as the processor's first step resizes it)."""
    from superfluid.plugins.http.images import decode

    return decode(png(image), "image", layout(hf_dir), 1 << 30)


def prompt(hf_dir: str | Path, text_before: str, images: Sequence[Image], text_after: str = ""
           ) -> tuple[list[int], tuple[MediaSpan, ...]]:
    """Tokens (with placeholders) and spans of ``text_before``, the images, ``text_after``, laid
    out by our layout (core/media.py) for the images as the front end fits them; checked equal,
    token for token, to what transformers' processor makes of the same text and images."""
    tok = _tokenizer(str(hf_dir))
    info = layout(hf_dir)
    tokens = tok.encode(text_before, add_special_tokens=False)
    spans: list[MediaSpan] = []
    for image in images:
        laid, placed = info.place(fit(hf_dir, image), len(tokens))
        tokens += laid
        spans += placed
    tokens += tok.encode(text_after, add_special_tokens=False)
    theirs = processed(hf_dir, text_before + "<image>" * len(images) + text_after, images)["input_ids"][0].tolist()
    image_id = processor(str(hf_dir)).image_token_id
    assert [image_id if t < 0 else t for t in tokens] == theirs, "our layout is not the processor's"
    return tokens, tuple(spans)


def processed(hf_dir: str | Path, text: str, images: Sequence[Image]) -> dict:
    """transformers' processor output (numpy) for ``text`` holding one ``<image>`` per image;
    ``rows`` / ``cols``: each image's tile grid."""
    proc = processor(str(hf_dir))
    pictures = [[pil(i) for i in images]] if images else None
    out = dict(proc(text=[text], images=pictures, return_tensors="np", add_special_tokens=False))
    if images:  # the processor drops the grid from its output; its image processor tells it
        grid = proc.image_processor(pictures, return_row_col_info=True)
        out["rows"], out["cols"] = grid["rows"], grid["cols"]
    return out


def features(hf_dir: str | Path, images: Sequence[Image]) -> list[np.ndarray]:
    """transformers' image features (the connector's output) for each image, as the processor
    cuts it: ``(tiles + 1) * rows × hidden``, tiles then the global image."""
    import torch

    model = _model(str(hf_dir))
    out = []
    for image in images:
        p = processed(hf_dir, "<image>", [image])
        with torch.no_grad():
            rows = model.model.get_image_features(
                pixel_values=torch.from_numpy(p["pixel_values"]),
                pixel_attention_mask=torch.from_numpy(p["pixel_attention_mask"])).pooler_output
        out.append(torch.cat(list(rows)).reshape(-1, model.config.text_config.hidden_size).numpy())
    return out


def generate(hf_dir: str | Path, text: str, images: Sequence[Image], max_new: int) -> tuple[list[int], int]:
    """(transformers' greedy continuation, no early end at end-of-text; the prompt's length) of
    ``text`` holding one ``<image>`` per image, processed by the fixture's processor."""
    p = processed(hf_dir, text, images)
    return _generate(hf_dir, p["input_ids"], p if images else None, max_new), int(p["input_ids"].shape[1])


def greedy(hf_dir: str | Path, tokens: Sequence[int], spans: Sequence[MediaSpan], max_new: int) -> list[int]:
    """transformers' greedy continuation of a prompt laid out by :func:`prompt` (placeholders
    become the image token), its images' pixels cut by transformers' processor (from the fitted
    images, which its first resize leaves as they are)."""
    image_id = processor(str(hf_dir)).image_token_id
    ids = np.asarray([[image_id if t < 0 else t for t in tokens]])
    pixels = None
    if spans:
        pixels = processor(str(hf_dir)).image_processor([[pil(i) for i in images_of(spans)]], return_tensors="np")
    return _generate(hf_dir, ids, pixels, max_new)


def _generate(hf_dir, ids: np.ndarray, pixels, max_new: int) -> list[int]:
    import torch

    model = _model(str(hf_dir))
    ids = torch.from_numpy(np.asarray(ids))
    kwargs = {}
    if pixels is not None:
        kwargs = {"pixel_values": torch.from_numpy(np.asarray(pixels["pixel_values"])),
                  "pixel_attention_mask": torch.from_numpy(np.asarray(pixels["pixel_attention_mask"]))}
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new,
                             min_new_tokens=max_new, do_sample=False, **kwargs)
    return out[0, ids.shape[1]:].tolist()
