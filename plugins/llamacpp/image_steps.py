"""Image rows on llama.cpp: a lane whose feed reaches an image's placeholders feeds the image's
embedding rows there, in a step of their own (``llama_decode`` takes token rows or embedding
rows, never both), lanes' images together in one decode. The runner (:mod:`.runner`) takes this
as a mixin: it calls :meth:`ImageSteps._image_step` when a feed starts with placeholders."""

from __future__ import annotations

import time

import llama_cpp
import numpy as np

from superfluid.core.media import EncoderCache, leading_placeholders
from superfluid.core.media_encoding import encoder_cache
from superfluid.core.tick import StepTiming
from superfluid.core.tick_runner import Work


def _slot(w: Work) -> int:
    return w.slot


class ImageSteps:
    """What :class:`~.runner.LlamaCppRunner` needs to feed image rows (it has ``ctx``, ``model``,
    ``n_ubatch``, ``samplers``, ``_sample``, ``_decode_failed`` and ``is_eog``)."""

    media: EncoderCache | None = None
    _image_batch = None

    def take_images(self, encode, mode: str | None = None) -> None:
        """Serve images: ``encode`` (an image to its embedding rows) behind the encoder cache,
        encoding on a background thread while ticks run (``mode`` "tick": on the tick)."""
        self.media = encoder_cache(encode, mode)

    def free_images(self) -> None:
        if self.media is not None and hasattr(self.media, "close"):
            self.media.close()
        if self._image_batch is not None:
            llama_cpp.llama_batch_free(self._image_batch[0])
            self._image_batch = None

    def _image_step(self, images: list[Work], limit: int, steps: list[StepTiming]) -> bool:
        """One forward pass of image rows: each lane whose feed starts with placeholders feeds the
        embedding rows of its image(s) there (encoded on first use, by content hash), in slot
        order, up to the step's room. llama.cpp decodes a batch of either tokens or embeddings,
        so token rows wait for the next step."""
        batch, rows_view, width = self._embedding_batch()
        room = self.n_ubatch if limit <= 0 else min(self.n_ubatch, limit)
        taken: list[tuple[Work, int, int]] = []
        n = 0
        t0 = time.perf_counter()
        for w in sorted(images, key=_slot):
            if room <= 0:
                break
            count = min(leading_placeholders(w.feed), room)
            if w.held is not None:  # up to an image still encoding
                count = min(count, w.held)
            rows_view[n * width:(n + count) * width] = self.media.row_block(w.media, w.pos, count).reshape(-1)
            for i in range(count):
                batch.pos[n + i] = w.pos + i
                batch.n_seq_id[n + i] = 1
                batch.seq_id[n + i][0] = w.slot
                batch.logits[n + i] = False
            if count == len(w.feed) and w.sample:
                batch.logits[n + count - 1] = True
            taken.append((w, n, count))
            n += count
            room -= count
        batch.n_tokens = n
        rc = llama_cpp.llama_decode(self.ctx, batch)
        if rc != 0 and not self._decode_failed(rc, n):
            return False
        for w, first, count in taken:
            del w.feed[:count]
            w.pos += count
            w.result.n_fed += count
            w.result.n_prefill += count
            if not w.feed and w.sample:
                token, logprob = self._sample(w.slot, self.samplers.get(w.slot), first + count - 1)
                w.sampled(token, self.is_eog(token), logprob)
        steps.append(StepTiming(prefill_tokens=n, decode_tokens=0, seconds=time.perf_counter() - t0))
        return True

    def _embedding_batch(self):
        """(the embedding batch, a float32 view of its rows, the row width), made once."""
        if self._image_batch is None:
            width = llama_cpp.llama_model_n_embd_inp(self.model)
            batch = llama_cpp.llama_batch_init(self.n_ubatch, width, 1)
            view = np.ctypeslib.as_array(batch.embd, shape=(self.n_ubatch * width,))
            self._image_batch = (batch, view, width)
        return self._image_batch
