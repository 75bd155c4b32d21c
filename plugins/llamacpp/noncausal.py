"""Image steps with non-causal attention (Gemma 3): an image's rows attend to each other both ways.

libmtmd says which projectors need it (``mtmd_decode_use_non_causal``: Gemma 3, Gemma 4's larger
sizes, DeepSeek-V4) and decodes such an image with ``llama_set_causal_attn(ctx, false)``, a
setting of the whole context: every row of that ``llama_decode`` attends to every cell of its own
sequence, later rows of the same batch included. What that allows, on an engine that decodes many
lanes a step:

* Text cannot share the step (it could not anyway: one ``llama_decode`` takes token rows or
  embedding rows, never both), so an image step is a step of its own, and the lanes that feed
  text sit it out. They lose that step and no more when image steps never run back to back while
  text waits (:func:`next_step_is_images`).
* Several lanes' images can share the step: a row only sees its own sequence's cells. But each
  image must reach llama.cpp whole in one micro-batch, or its first rows miss its last ones.
  llama.cpp splits a batch into micro-batches of ``n_ubatch`` rows, and with a KV per sequence
  (or Gemma 3's sliding-window KV, unless unified) it splits *equally*: each micro-batch takes the
  same number of rows from every sequence in it. So a step carries one whole image per lane, all
  of one row count (Gemma 3's images all have ``mm_tokens_per_image`` rows), and no more images
  than ``n_ubatch`` holds (:func:`pick_images`). A model whose image is longer than ``n_ubatch``
  cannot be served this way: refuse it when it loads.
* The setting must come back on even when the decode fails or is aborted
  (:func:`non_causal_attention`).
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Sequence


@contextlib.contextmanager
def non_causal_attention(ctx) -> Iterator[None]:
    """Causal attention off for the decodes inside, back on after them, whatever happens."""
    import llama_cpp

    llama_cpp.llama_set_causal_attn(ctx, False)
    try:
        yield
    finally:
        llama_cpp.llama_set_causal_attn(ctx, True)


def pick_images(candidates: Sequence[tuple[int, int]], n_ubatch: int) -> list[int]:
    """Which lanes feed an image in this step: ``candidates`` are ``(slot, rows)`` for each lane
    whose feed starts with an image (``rows``: that image's rows), in the order the planner
    serves them. Each picked lane feeds that one image whole; all picked images have the first
    one's row count, and together they fit ``n_ubatch``. The rest wait for the next image step."""
    picked: list[int] = []
    if not candidates:
        return picked
    rows = candidates[0][1]
    if rows > n_ubatch:
        raise ValueError(f"an image of {rows} rows cannot be decoded whole in micro-batches of {n_ubatch}")
    for slot, n in candidates:
        if n == rows and (len(picked) + 1) * rows <= n_ubatch:
            picked.append(slot)
    return picked


def next_step_is_images(images_waiting: bool, text_waiting: bool, last_was_images: bool) -> bool:
    """Whether the next step decodes image rows: when images wait, unless the last step already
    did and text waits too (lanes feeding text then lose one step to an image step, never two in
    a row)."""
    return images_waiting and not (last_was_images and text_waiting)
