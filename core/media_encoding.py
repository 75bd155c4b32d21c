"""Images encoded while the tick runs, not on it.

A vision tower of a real size (SigLIP-400M: Gemma 3's, SmolVLM-2B's) takes seconds an image on a
CPU. Encoded on the tick thread at a lane's first image step, that is seconds in which no other
lane steps: every text neighbour's stream stalls. The spec binds media at admission, so the
engine starts encoding a lane's images as soon as its work reaches the engine (the first tick
that plans it, :func:`prefetch`), on one background thread of the engine's process, while the
tick goes on stepping the other lanes.

:class:`ImageEncoder` is the engine's :class:`~superfluid.core.media.EncoderCache` with that
thread behind it: images stay cached by content hash as before, and an encode is counted once,
when its rows enter the cache. The tick (``core/tick_runner.py``) asks :func:`runnable` before
each step which lanes may step: a lane whose feed has reached an image still encoding waits
(``Work.held`` says how much of its feed may go before it), the others step; a lane whose image
failed to encode ends with ``LaneResult.error``, which fails that request alone. When only
waiting lanes are left the tick ends, or, if nothing stepped in it at all, waits a little for an
encode first (:func:`wait`), so an idle engine does not spin through empty ticks.

``image-encoding = "tick"`` keeps the old way (encode when the feed reaches the image, on the
tick thread, before the step): for measuring what the background buys, and as a fallback."""

from __future__ import annotations

import time
from collections import OrderedDict
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from typing import TYPE_CHECKING, Callable, Iterable, Sequence

import numpy as np

from .media import EncoderCache, Image, MediaSpan

if TYPE_CHECKING:
    from .stop_flag import StopFlag
    from .tick import LanePlan
    from .tick_runner import Work

MODES = ("admission", "tick")
DEFAULT_MODE = "admission"
IDLE_WAIT_S = 0.05     # a tick where nothing could step waits at most this (or its target) for an encode
POLL_S = 0.01          # ... reading the stop flag this often
KEPT_FAILURES = 64     # failed images remembered (their lanes are told once each tick they reach them)


class ImageEncoder(EncoderCache):
    """An :class:`EncoderCache` whose encodes run on one background thread (``background``) or
    on the caller's (the tick's) thread. Everything but the encode itself runs on the tick
    thread: the cache, the futures dict and the failures are touched only there, so the one
    object two threads share is each encode's ``Future``."""

    def __init__(self, encode: Callable[[Image], np.ndarray], *, background: bool = True,
                 max_bytes: int = 256 << 20):
        super().__init__(self._take, max_bytes)
        self._encode_now = encode
        self.background = background
        self._pending: dict[str, Future] = {}
        self._images: dict[str, Image] = {}  # the images of the pending encodes
        self._failed: OrderedDict[str, str] = OrderedDict()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="superfluid-image-encoder") if background else None

    @property
    def mode(self) -> str:
        return "admission" if self.background else "tick"

    def holds(self, image: Image) -> bool:
        return image.digest in self._rows

    def prefetch(self, image: Image) -> None:
        """Start encoding ``image`` in the background unless it is cached, under way or failed."""
        d = image.digest
        if self._pool is None or d in self._rows or d in self._pending or d in self._failed:
            return
        self._pending[d] = self._pool.submit(self._encode_now, image)
        self._images[d] = image

    def collect(self) -> None:
        """Take every finished encode into the cache (or the failures), so the rows of an image
        whose request went away meanwhile are bounded by the cache like any others."""
        for d in [d for d, fut in self._pending.items() if fut.done()]:
            self.ready(self._images[d])

    def ready(self, image: Image) -> bool:
        """Whether ``image``'s rows can be fed now (or its encode has failed: :meth:`failure`).
        In the background a finished encode enters the cache here; on the tick the image is
        encoded now, on this thread."""
        d = image.digest
        if d in self._rows or d in self._failed:
            return True
        fut = self._pending.get(d)
        if fut is None and self._pool is not None:
            self.prefetch(image)  # evicted from the cache since, or never prefetched
            return False
        if fut is not None and not fut.done():
            return False
        try:
            self.rows(image)  # takes the result (or encodes now), counted once
        except Exception as exc:  # noqa: BLE001 - any encoder error fails the lanes of that image only
            self._failed[d] = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            while len(self._failed) > KEPT_FAILURES:
                self._failed.popitem(last=False)
        return True

    def failure(self, image: Image) -> str | None:
        """Why ``image`` could not be encoded (None: it was, or it is not done yet)."""
        return self._failed.get(image.digest)

    def in_flight(self, images: Iterable[Image]) -> list[Future]:
        return [f for f in (self._pending.get(i.digest) for i in images) if f is not None and not f.done()]

    def _take(self, image: Image) -> np.ndarray:
        """The cache's encode: the background result when there is one (waiting for it if it is
        still running), else an encode now."""
        fut = self._pending.pop(image.digest, None)
        self._images.pop(image.digest, None)
        if fut is None:
            return self._encode_now(image)
        return fut.result()

    def close(self) -> None:
        """Drop the encodes not started and wait for the one running (the encoder it calls may
        be freed next)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)


def encoder_cache(encode: Callable[[Image], np.ndarray], mode: str | None = None) -> ImageEncoder:
    """The engine's image cache for its ``image-encoding`` option (``admission``: background)."""
    return ImageEncoder(encode, background=(mode or DEFAULT_MODE) != "tick")


def prefetch(media: ImageEncoder, lanes: Sequence[LanePlan]) -> None:
    """Start encoding the images a tick's lane plans bind (the first tick that plans a lane is
    the first time its work reaches the engine)."""
    media.collect()
    for lp in lanes:
        for span in lp.media:
            media.prefetch(span.image)


def _held_at(w: Work, media: ImageEncoder) -> tuple[int | None, str | None]:
    """(how many of the feed's tokens come before the first image that is not encoded yet, or
    None; the error of the first image the feed reaches that failed, or None)."""
    end = w.pos + len(w.feed)
    for span in sorted(w.media, key=_start):
        if span.end <= w.pos or span.start >= end:
            continue
        if not media.ready(span.image):
            return max(0, span.start - w.pos), None
        error = media.failure(span.image)
        if error is not None:
            return max(0, span.start - w.pos), error
    return None, None


def _start(span: MediaSpan) -> int:
    return span.start


def runnable(active: list[Work], media: ImageEncoder) -> list[Work]:
    """The lanes that may step now. Each lane with images gets ``held`` (how much of its feed
    comes before an image still encoding, None: all of it); a lane held at 0 waits. A lane whose
    feed reaches an image that failed to encode ends there: its text before it goes first, then
    ``result.error`` is set and its feed dropped (:func:`done_failing`)."""
    out = []
    for w in active:
        if not w.media:
            out.append(w)
            continue
        held, error = _held_at(w, media)
        w.held = held
        if error is not None and held == 0:
            w.result.error = f"the image could not be encoded ({error})"
            w.feed = []
            w.sample = False
            continue
        if held != 0:
            out.append(w)
    return out


def wait(active: list[Work], media: ImageEncoder, others_done: bool, started: float, target_s: float, stop_flag: StopFlag) -> bool:
    """Every lane left waits for an image. If other lanes stepped in this tick and are done
    (``others_done``), end it (False) so their tokens go out and the next tick steps them again;
    else wait for an encode until the tick's target (at least :data:`IDLE_WAIT_S`) has passed or
    the stop flag is raised. True: an image may be ready, look again."""
    if others_done:
        return False
    deadline = started + max(target_s, IDLE_WAIT_S)
    while True:
        left = deadline - time.perf_counter()
        if left <= 0 or stop_flag.stop_requested():
            return False
        pending = media.in_flight(span.image for w in active for span in w.media)
        if not pending:
            return True
        done, _ = wait_futures(pending, timeout=min(POLL_S, left), return_when=FIRST_COMPLETED)
        if done:
            return True
