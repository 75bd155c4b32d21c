"""Image rows on llama.cpp: a lane whose feed reaches an image's placeholders feeds the image's
embedding rows there, in a step of their own (``llama_decode`` takes token rows or embedding
rows, never both), lanes' images together in one decode. The runner (:mod:`.runner`) takes this
as a mixin: it calls :meth:`ImageSteps._image_step` when a feed starts with placeholders."""

from __future__ import annotations

import logging
import time

import llama_cpp
import numpy as np

from superfluid.core.media import EncoderCache, leading_placeholders, span_at
from superfluid.core.media_encoding import encoder_cache
from superfluid.core.tick import StepTiming
from superfluid.core.tick_runner import Work

from .embd_batch import EmbeddingBatch
from .mrope import N_POS
from .noncausal import next_step_is_images, non_causal_attention, pick_images

log = logging.getLogger(__name__)


def _slot(w: Work) -> int:
    return w.slot


class ImageSteps:
    """What :class:`~.runner.LlamaCppRunner` needs to feed image rows (it has ``ctx``, ``model``,
    ``n_ubatch``, ``samplers``, ``_sample``, ``_decode_failed``, ``is_eog`` and ``positions``)."""

    media: EncoderCache | None = None
    _image_batch: EmbeddingBatch | None = None
    mrope = False        # rows take 4 positions (time, row, column, 0): Qwen-VL
    non_causal = False   # an image's rows attend both ways: Gemma 3
    _last_was_images = False

    def take_images(self, encode, mode: str | None = None) -> None:
        """Serve images: ``encode`` (an image to its embedding rows) behind the encoder cache,
        encoding on a background thread while ticks run (``mode`` "tick": on the tick). The
        encoder says how its rows decode (``mrope``: 4 positions a row; ``non_causal``: one whole
        image a lane a step, attention both ways)."""
        self.mrope = bool(getattr(encode, "mrope", False))
        self.non_causal = bool(getattr(encode, "non_causal", False))
        rows = getattr(getattr(encode, "layout", None), "rows", 0)
        if self.non_causal and rows > self.n_ubatch:  # such a decode aborts the process (noncausal.py)
            raise RuntimeError(f"images of {rows} rows decode whole with non-causal attention: "
                               f"n_ubatch {self.n_ubatch} is too small")
        self.media = encoder_cache(encode, mode)

    def free_images(self) -> None:
        if self.media is not None and hasattr(self.media, "close"):
            self.media.close()
        self._image_batch = None

    def image_step_now(self, images: list[Work], text_waiting: bool) -> bool:
        """Whether the next step feeds image rows: when a lane's feed starts with them, but never
        twice in a row while other lanes have text or a token to feed (they lose one step to an
        image, never two: :func:`.noncausal.next_step_is_images`)."""
        now = next_step_is_images(bool(images), text_waiting, self._last_was_images)
        self._last_was_images = now
        return now

    def _image_step(self, images: list[Work], limit: int, steps: list[StepTiming]) -> bool:
        """One forward pass of image rows: each lane whose feed starts with placeholders feeds the
        embedding rows of its image(s) there (encoded on first use, by content hash), in slot
        order, up to the step's room. llama.cpp decodes a batch of either tokens or embeddings,
        so token rows wait for the next step. Under M-RoPE each row takes its 4 positions
        (:class:`.mrope.Positions`); with non-causal attention each chosen lane feeds one whole
        image, all of one length (:func:`.noncausal.pick_images`), with causal attention off."""
        eb = self._embedding_batch()
        eb.clear()
        t0 = time.perf_counter()
        shares = self._whole_images(images) if self.non_causal else None
        if shares is None:
            room = self.n_ubatch if limit <= 0 else min(self.n_ubatch, limit)
            shares = []
            for w in sorted(images, key=_slot):
                if room <= 0:
                    break
                count = min(leading_placeholders(w.feed), room)
                if w.held is not None:  # up to an image still encoding
                    count = min(count, w.held)
                shares.append((w, count))
                room -= count
        taken: list[tuple[Work, int, int]] = []
        for w, count in shares:
            p = self.positions(w.slot)
            at = p.rows(w.pos, count) if p is not None else np.arange(w.pos, w.pos + count, dtype=np.int32)
            if self.mrope and p is None:  # no image grids: text-like positions (p, p, p, 0)
                at = np.stack([at, at, at, np.zeros_like(at)])
            elif not self.mrope and p is not None:
                at = at[0]
            first = eb.add(self.media.row_block(w.media, w.pos, count), at, w.slot,
                           logits_last=count == len(w.feed) and w.sample)
            taken.append((w, first, count))
        n = eb.n
        if self.non_causal:
            with non_causal_attention(self.ctx):
                rc = llama_cpp.llama_decode(self.ctx, eb.batch())
        else:
            rc = llama_cpp.llama_decode(self.ctx, eb.batch())
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

    def _whole_images(self, images: list[Work]) -> list[tuple[Work, int]] | None:
        """(lane, rows) for the lanes that feed one whole image each in a non-causal step; None
        when no lane's feed holds a whole image (the planner sends images whole, so that is a
        lane cut inside one: it goes on causally rather than stall)."""
        candidates = []
        for w in sorted(images, key=_slot):
            span = span_at(w.media, w.pos)
            whole = span.start == w.pos and leading_placeholders(w.feed) >= span.rows
            if whole and (w.held is None or w.held >= span.rows):
                candidates.append((w, span.rows))
        if not candidates:
            log.warning("non-causal image rows not whole in any lane's feed (slots %s): decoded causally",
                        [w.slot for w in images])
            return None
        picked = set(pick_images([(w.slot, rows) for w, rows in candidates], self.n_ubatch))
        return [(w, rows) for w, rows in candidates if w.slot in picked]

    def _embedding_batch(self) -> EmbeddingBatch:
        """The embedding batch (rows as wide as the model's input, 4 positions a row under
        M-RoPE), made once."""
        if self._image_batch is None:
            width = llama_cpp.llama_model_n_embd_inp(self.model)
            self._image_batch = EmbeddingBatch(self.n_ubatch, width, N_POS if self.mrope else 1)
        return self._image_batch
