"""core/media_encoding.py: images encoded on a background thread while the tick steps other lanes,
driven through core's real tick (TickRunner) with a tiny in-memory engine. The encoder is a
function the test holds back with an event, so "still encoding" is a state the test controls, not
a race. (What it buys in time is tools/bench/images.py's to measure.)"""

from __future__ import annotations

import threading

import numpy as np
import pytest

from superfluid.core.media import Image, MediaSpan, placeholder
from superfluid.core.media_encoding import ImageEncoder, encoder_cache
from superfluid.core.request import SamplingParams
from superfluid.core.stop_flag import StopFlag
from superfluid.core.tick import LanePlan, StepTiming, TickPlan
from superfluid.core.tick_runner import TickRunner, prefill_shares, takes_one

GREEDY = SamplingParams(temperature=0.0)
ROWS = 3


def image(value: int) -> Image:
    return Image.from_rgb(2, 2, bytes([value]) * 12)


class HeldEncoder:
    """An image to ROWS rows of its first pixel's value; blocks until ``release`` (or raises
    ``fail`` when set), recording the thread each encode ran on."""

    def __init__(self):
        self.go = threading.Event()
        self.threads: list[str] = []
        self.calls = 0
        self.fail: Exception | None = None

    def __call__(self, img: Image) -> np.ndarray:
        self.calls += 1
        self.threads.append(threading.current_thread().name)
        assert self.go.wait(5.0), "the test never released the encoder"
        if self.fail is not None:
            raise self.fail
        return np.full((ROWS, 2), float(img.pixels[0]), dtype=np.float32)


class RowsRunner(TickRunner):
    """Each step feeds one token to every single-token lane and up to 8 prefill tokens per lane
    (``prefill_shares``, which stops at an image still encoding); a placeholder is fed as its
    image's row value (from ``self.media``). It samples ``len(kv)``, the slot's KV length."""

    def __init__(self, encode, mode="admission", stop_flag=None):
        super().__init__(stop_flag or StopFlag(), kv_capacity=1000)
        self.media = encoder_cache(encode, mode)
        self.kv: dict[int, list[float]] = {}
        self.steps_run = 0

    def clear_kv(self, slot):
        self.kv.pop(slot, None)

    def cut(self, slot, pos):
        del self.kv.setdefault(slot, [])[pos:]

    def keep_prefix(self, slot, pos):
        del self.kv.setdefault(slot, [])[pos:]
        return len(self.kv[slot]) == pos

    def kv_used(self, touched):
        return sum(len(v) for v in self.kv.values())

    def new_sampler(self, lp):
        self.samplers[lp.slot] = object()

    def accepts(self, slot):
        return False

    def advance(self, active, plan, result):
        self.steps_run += 1
        shares = [(w, 1) for w in active if takes_one(w)] + prefill_shares(active, plan, 8)
        for w, count in shares:
            fed = w.feed[:count]
            values = [float(t) for t in fed]
            for i, t in enumerate(fed):
                if t < 0:
                    values[i] = float(self.media.row_block(w.media, w.pos + i, 1)[0, 0])
            self.kv.setdefault(w.slot, []).extend(values)
            del w.feed[:count]
            w.pos += count
            w.result.n_fed += count
            if w.sample and not w.feed:
                w.sampled(len(self.kv[w.slot]), False)
        result.steps.append(StepTiming(prefill_tokens=0, decode_tokens=len(active), seconds=0.0))
        return True


def text_lane(slot=0, max_new=4) -> LanePlan:
    return LanePlan(slot=slot, pos=0, feed=[5, 6], sample=True, max_new=max_new, reset=True, sampling=GREEDY)


def image_lane(img: Image, slot=1, before=(7, 8), after=(9,)) -> LanePlan:
    feed = [*before, *([placeholder(img.digest)] * ROWS), *after]
    span = MediaSpan(image=img, start=len(before), rows=ROWS)
    return LanePlan(slot=slot, pos=0, feed=feed, sample=True, max_new=1, reset=True, sampling=GREEDY,
                    media=(span,))


def test_an_image_encodes_in_the_background_while_the_other_lane_steps():
    enc = HeldEncoder()
    runner = RowsRunner(enc)
    red = image(200)
    try:
        result = runner.run(TickPlan(lanes=[text_lane(), image_lane(red)], target_s=0.0))
        text, img = result.lanes[0], result.lanes[1]
        assert text.tokens == [2, 3, 4, 5]  # the text lane ran its whole grant
        assert img.n_fed == 2 and img.tokens == []  # its text before the image only: it waits
        assert result.stopped_early and result.encoded == 0 and result.lanes[1].error is None
        assert enc.threads and enc.threads[0].startswith("superfluid-image-encoder")

        enc.go.set()
        again = runner.run(TickPlan(lanes=[LanePlan(slot=1, pos=2, feed=image_lane(red).feed[2:], sample=True,
                                                    max_new=1, media=image_lane(red).media)], target_s=1.0))
        assert again.lanes[1].tokens == [6] and not again.stopped_early
        assert runner.kv[1] == [7.0, 8.0, 200.0, 200.0, 200.0, 9.0]
        assert again.encoded == 1 and runner.media.encodes == 1 and enc.calls == 1
    finally:
        enc.go.set()
        runner.media.close()


def test_a_tick_with_nothing_else_to_step_waits_for_the_encode():
    enc = HeldEncoder()
    runner = RowsRunner(enc)
    timer = threading.Timer(0.05, enc.go.set)
    timer.start()
    try:
        result = runner.run(TickPlan(lanes=[image_lane(image(9))], target_s=5.0))
        assert result.lanes[1].tokens == [6] and not result.stopped_early and result.encoded == 1
    finally:
        timer.cancel()
        enc.go.set()
        runner.media.close()


def test_the_stop_flag_ends_a_tick_that_waits_for_an_encode():
    enc = HeldEncoder()
    flag = StopFlag()
    runner = RowsRunner(enc, stop_flag=flag)
    timer = threading.Timer(0.05, flag.request_yield)
    timer.start()
    try:
        result = runner.run(TickPlan(lanes=[image_lane(image(9))], target_s=30.0))
        assert result.stopped_early and result.lanes[1].n_fed == 2 and result.lanes[1].tokens == []
    finally:
        timer.cancel()
        enc.go.set()
        runner.media.close()


def test_an_image_that_fails_to_encode_fails_its_lane_only():
    enc = HeldEncoder()
    enc.fail = RuntimeError("mtmd_encode_chunk failed")
    enc.go.set()
    runner = RowsRunner(enc)
    try:
        result = runner.run(TickPlan(lanes=[text_lane(), image_lane(image(3))], target_s=5.0))
        assert result.lanes[0].tokens == [2, 3, 4, 5] and result.lanes[0].error is None
        err = result.lanes[1].error
        assert err is not None and "could not be encoded" in err and "mtmd_encode_chunk failed" in err
        assert result.lanes[1].n_fed == 2 and result.lanes[1].tokens == []
        assert runner.media.encodes == 0
    finally:
        runner.media.close()


def test_on_the_tick_the_encode_runs_on_the_tick_thread():
    enc = HeldEncoder()
    enc.go.set()
    runner = RowsRunner(enc, mode="tick")
    result = runner.run(TickPlan(lanes=[text_lane(), image_lane(image(50))], target_s=0.0))
    assert result.lanes[1].tokens == [6] and result.encoded == 1
    assert enc.threads == [threading.current_thread().name]
    assert runner.kv[1][2:5] == [50.0] * 3


def test_images_stay_cached_by_content_and_encode_once():
    enc = HeldEncoder()
    enc.go.set()
    cache = ImageEncoder(enc)
    try:
        red, same = image(1), image(1)
        cache.prefetch(red)
        cache.prefetch(same)
        while not cache.ready(red):
            threading.Event().wait(0.005)
        assert cache.ready(same) and cache.holds(same)
        cache.prefetch(red)
        assert enc.calls == 1 and cache.encodes == 1
        assert cache.rows(same)[0, 0] == 1.0
    finally:
        cache.close()


def test_an_image_never_prefetched_starts_when_asked_for():
    enc = HeldEncoder()
    cache = ImageEncoder(enc)
    try:
        blue = image(77)
        assert not cache.ready(blue)  # started now, not encoded on the caller's thread
        enc.go.set()
        assert cache.rows(blue)[0, 0] == 77.0  # waits for the background result
        assert enc.calls == 1 and cache.encodes == 1 and enc.threads[0].startswith("superfluid-image-encoder")
    finally:
        cache.close()


@pytest.mark.parametrize("mode", ["admission", "tick"])
def test_two_images_in_one_feed_each_wait_their_turn(mode):
    enc = HeldEncoder()
    enc.go.set()
    runner = RowsRunner(enc, mode=mode)
    a, b = image(10), image(20)
    feed = [1, *([placeholder(a.digest)] * ROWS), 2, *([placeholder(b.digest)] * ROWS), 3]
    spans = (MediaSpan(image=a, start=1, rows=ROWS), MediaSpan(image=b, start=2 + ROWS, rows=ROWS))
    try:
        result = runner.run(TickPlan(lanes=[LanePlan(slot=0, pos=0, feed=feed, sample=True, max_new=1, reset=True,
                                                     sampling=GREEDY, media=spans)], target_s=5.0))
        assert result.lanes[0].tokens == [len(feed)]
        assert runner.kv[0] == [1.0, 10.0, 10.0, 10.0, 2.0, 20.0, 20.0, 20.0, 3.0]
        assert runner.media.encodes == 2
    finally:
        runner.media.close()


def test_a_finished_encode_nobody_asked_for_enters_the_cache_at_the_next_tick():
    enc = HeldEncoder()
    enc.go.set()
    runner = RowsRunner(enc)
    try:
        gone = image(33)
        runner.media.prefetch(gone)  # its request went away before a tick fed it
        runner.media._pending[gone.digest].result(timeout=5)
        runner.run(TickPlan(lanes=[text_lane()]))
        assert runner.media.holds(gone) and not runner.media._pending and runner.media.encodes == 1
    finally:
        runner.media.close()
