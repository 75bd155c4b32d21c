"""M-RoPE positions on llama.cpp (Qwen2-VL, Qwen2.5-VL, Qwen3-VL): where each of a lane's tokens
sits, when an image's rows do not take one position each.

Under M-RoPE a position is four numbers (llama.cpp's ``n_pos_per_embd`` is 4: time, row, column,
and a fourth that these families leave at 0). libmtmd places the rows of an image whose merged
patch grid is ``nx`` across and ``ny`` down at time ``p0`` (the position the image starts at),
row ``p0 + i // nx``, column ``p0 + i % nx``, and the text after the image at
``p0 + max(nx, ny)`` (``mtmd_image_tokens_get_decoder_pos``, ``mtmd_image_tokens_get_n_pos``).
So past the first image a lane's next position is no longer its token count: it lags behind by
``nx * ny - max(nx, ny)`` per image.

:class:`Positions` is that mapping for one lane, from its images' :class:`Grid`\\ s: token index
(the count core keeps: prompt tokens with one placeholder per image row) to llama.cpp position.
It is the whole of what the engine needs to feed a lane, cut it back, copy, park or restore it:

* :meth:`Positions.rows` gives the ``4 × count`` positions of any run of rows, text or image,
  as an embedding batch wants them (:mod:`.embd_batch` lays them out section-major);
* a token batch takes one position a row (:meth:`Positions.of`): llama.cpp widens it to
  ``(p, p, p, 0)`` itself;
* the KV keeps only the time position of a cell (its row and column ride along in the cell, and
  in a state saved with ``llama_state_seq_get_data``), so every row of an image sits at ``p0``:
  a cut (``llama_memory_seq_rm`` from a position) can only fall at an image's start or end,
  :meth:`Positions.snap` finds it, and after ``n`` tokens ``llama_memory_seq_pos_max`` is
  :meth:`Positions.last`, not ``n - 1``.
"""

from __future__ import annotations

import bisect
from typing import Sequence

import attrs
import numpy as np

N_POS = 4  # positions per row under M-RoPE (llama.cpp's GGML_MROPE_SECTIONS)


@attrs.define(frozen=True)
class Grid:
    """An image in a lane's tokens: its rows are token indices ``start`` … ``start + nx*ny - 1``,
    row-major over a merged patch grid ``nx`` across and ``ny`` down (libmtmd's
    ``mtmd_image_tokens_get_nx`` / ``_ny``)."""

    start: int
    nx: int
    ny: int

    @property
    def rows(self) -> int:
        return self.nx * self.ny

    @property
    def end(self) -> int:
        return self.start + self.rows

    @property
    def n_pos(self) -> int:
        """Positions the image takes: the next token goes this far past its start."""
        return max(self.nx, self.ny)


class Positions:
    """Token index to llama.cpp position for one lane whose tokens hold images at ``grids``
    (in order, not overlapping); text tokens take one position each."""

    def __init__(self, grids: Sequence[Grid] = ()):
        self.grids = sorted(grids, key=lambda g: g.start)
        for a, b in zip(self.grids, self.grids[1:]):
            if b.start < a.end:
                raise ValueError(f"images overlap: rows {a.start}..{a.end - 1} and {b.start}..{b.end - 1}")
        self._starts = [g.start for g in self.grids]
        # _lag[k]: how far positions trail token indices past the first k images
        self._lag = [0]
        for g in self.grids:
            self._lag.append(self._lag[-1] + g.rows - g.n_pos)

    def _image(self, index: int) -> tuple[int, Grid | None]:
        """(images wholly before ``index``, the image holding ``index`` or None)."""
        k = bisect.bisect_right(self._starts, index)
        if k and index < self.grids[k - 1].end:
            return k - 1, self.grids[k - 1]
        return k, None

    def of(self, index: int) -> int:
        """The time position of token ``index``: a text token's position, or the start position
        ``p0`` every row of an image shares (what the KV stores for the cell)."""
        k, image = self._image(index)
        if image is not None:
            return image.start - self._lag[k]
        return index - self._lag[k]

    def next(self, n: int) -> int:
        """The position the token after the first ``n`` goes at: ``n`` for a lane without
        images, less the lag of every image within the ``n``. ``n`` may not fall inside an image."""
        k, image = self._image(n)
        if image is not None and n != image.start:
            raise ValueError(f"token count {n} falls inside the image at rows {image.start}..{image.end - 1}")
        return n - self._lag[k]

    def last(self, n: int) -> int:
        """``llama_memory_seq_pos_max`` of a sequence holding the first ``n`` tokens (-1 for
        none): the time position of token ``n - 1``."""
        return self.of(n - 1) if n > 0 else -1

    def snap(self, n: int) -> int:
        """``n``, or the start of the image ``n`` falls inside: the longest prefix of at most
        ``n`` tokens a sequence can be cut back to (a cut keeps an image whole or drops it)."""
        _, image = self._image(n)
        return image.start if image is not None and n != image.start else n

    def rows(self, start: int, count: int) -> np.ndarray:
        """The ``N_POS × count`` positions (time, row, column, 0) of tokens ``start`` …
        ``start + count - 1``, as llama.cpp takes them for embedding rows: a text token at ``p``
        is ``(p, p, p, 0)``, row ``i`` of an image at ``p0`` is ``(p0, p0 + i // nx, p0 + i % nx, 0)``."""
        out = np.zeros((N_POS, count), dtype=np.int32)
        i = 0
        while i < count:
            index = start + i
            k, image = self._image(index)
            if image is None:  # a run of text up to the next image
                stop = min(count, (self.grids[k].start - start) if k < len(self.grids) else count)
                p = np.arange(index, start + stop, dtype=np.int32) - self._lag[k]
                out[0, i:stop] = out[1, i:stop] = out[2, i:stop] = p
                i = stop
                continue
            stop = min(count, image.end - start)
            within = np.arange(index - image.start, stop + start - image.start, dtype=np.int32)
            p0 = image.start - self._lag[k]
            out[0, i:stop] = p0
            out[1, i:stop] = p0 + within // image.nx
            out[2, i:stop] = p0 + within % image.nx
            i = stop
        return out
