"""The transformers reference for the tiny SmolVLM (tools/fixtures/tiny_vlm.py): greedy tokens for
a prompt whose image rows are placeholders (core/media.py), computed by transformers'
``Idefics3ForConditionalGeneration`` in the test process, so every engine is compared with an
independent implementation rather than with frozen strings."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Sequence

from superfluid.core.media import Image, MediaSpan, VisionInfo, idefics3_layout

MEAN = STD = (0.5, 0.5, 0.5)


def solid(rgb: tuple[int, int, int], size: int = 64) -> Image:
    """A one-colour image of ``size`` pixels a side."""
    return Image.from_rgb(size, size, bytes(rgb) * (size * size))


def png(rgb: tuple[int, int, int], size: int = 64) -> bytes:
    """A one-colour PNG, as a client would send it."""
    import io

    from PIL import Image as PILImage

    buf = io.BytesIO()
    PILImage.new("RGB", (size, size), rgb).save(buf, format="PNG")
    return buf.getvalue()


@functools.cache
def _model(hf_dir: str):
    import torch
    from transformers import Idefics3ForConditionalGeneration

    torch.set_num_threads(2)
    return Idefics3ForConditionalGeneration.from_pretrained(hf_dir, dtype=torch.float32).eval()


@functools.cache
def _tokenizer(hf_dir: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(hf_dir)


def layout(hf_dir: str | Path) -> VisionInfo:
    tok = _tokenizer(str(hf_dir))
    ids = tok.get_vocab()
    return idefics3_layout(64, 16, 2, ids.get)


def prompt(hf_dir: str | Path, text_before: str, images: Sequence[Image], text_after: str = "") -> tuple[list[int], tuple[MediaSpan, ...]]:
    """Tokens (with placeholders) and spans for ``text_before``, the images, ``text_after``."""
    tok = _tokenizer(str(hf_dir))
    info = layout(hf_dir)
    tokens = tok.encode(text_before, add_special_tokens=False)
    spans = []
    for image in images:
        laid = info.prompt_tokens(image)
        start = len(tokens) + len(info.before)
        spans.append(MediaSpan(image=image, start=start, rows=info.rows))
        tokens += laid
    tokens += tok.encode(text_after, add_special_tokens=False)
    return tokens, tuple(spans)


def greedy(hf_dir: str | Path, tokens: Sequence[int], spans: Sequence[MediaSpan], max_new: int) -> list[int]:
    """transformers' greedy continuation (no early end at end-of-text) of a prompt with images."""
    import numpy as np
    import torch

    model = _model(str(hf_dir))
    image_id = model.config.image_token_id
    ids = torch.tensor([[image_id if t < 0 else t for t in tokens]])
    kwargs = {}
    if spans:
        pixels = np.stack([s.image.normalised(MEAN, STD) for s in spans])[None]
        kwargs["pixel_values"] = torch.from_numpy(pixels)
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new,
                             min_new_tokens=max_new, do_sample=False, **kwargs)
    return out[0, ids.shape[1]:].tolist()
