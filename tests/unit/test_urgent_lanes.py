"""The interactive promise beside media lanes (plugins/qos/admission.leaves_urgent_lanes): a media
lane is never preempted, so media lanes below the urgent classes leave ``--urgent-lanes`` lanes
to them, and a chat arriving while every other lane holds an image is admitted at once. Driven
through the real loop, scheduler and qos plugin on the fake engine (tests/unit/fakes.py), which
feeds an image's placeholders like tokens. Last, an image that fails to encode fails its own
request only (``LaneResult.error``)."""

from __future__ import annotations

import attrs
import pytest

from superfluid.core.lane import LaneState
from superfluid.core.media import Image, MediaSpan, VisionInfo, placeholder

from superfluid.core.tick import LaneResult

from .fakes import FakeEngine, drive, expected_tokens, step, submit

ROWS = 4


def vision_engine(max_lanes: int) -> FakeEngine:
    engine = FakeEngine(max_lanes=max_lanes)
    engine.capabilities = attrs.evolve(engine.capabilities, vision=True)
    engine.info = attrs.evolve(engine.info, vision=VisionInfo(tile=2, rows=ROWS))
    return engine


def with_image(loop, i: int, qos: str = "background", max_tokens: int = 200):
    img = Image.from_rgb(1, 1, bytes([i, 2, 3]))
    tokens = [10 + i, *([placeholder(img.digest)] * ROWS), 20 + i, 30 + i]
    return submit(loop, tokens, max_tokens, qos=qos, media=(MediaSpan(image=img, start=1, rows=ROWS),))


def lanes_of(loop, state):
    return [lane for lane in loop.scheduler.lanes if lane.state == state]


@pytest.mark.parametrize("max_batch", [2, 4])
def test_media_lanes_below_the_urgent_classes_leave_a_lane_and_a_chat_takes_it_at_once(make, max_batch):
    loop, engine = make(vision_engine(max_batch), start=False, max_batch=max_batch)
    media = [with_image(loop, i) for i in range(max_batch)]
    drive(loop, engine, lambda: len(loop.scheduler.lanes) == max_batch - 1 and all(
        lane.n_generated > 0 for lane in loop.scheduler.lanes))
    step(loop, engine)
    assert len(loop.scheduler.lanes) == max_batch - 1  # the last media request waits, a lane stays free
    assert len(loop.scheduler.queue) == 1
    _, chat = submit(loop, [500, 501, 502], 3, qos="interactive")
    plan, _ = step(loop, engine)
    assert any(lp.feed[:1] == [500] for lp in plan.lanes)  # admitted in the next tick
    drive(loop, engine, lambda: chat.token_ids)
    assert not any(sink.done.is_set() for _, sink in media)  # no media lane had to end first
    assert engine.errors == []


def test_a_text_agent_may_take_the_last_lane_and_the_chat_preempts_it(make):
    loop, engine = make(vision_engine(2), start=False, max_batch=2)
    with_image(loop, 1)
    _, agent = submit(loop, [40, 41, 42], 200, qos="agent")
    drive(loop, engine, lambda: len(loop.scheduler.lanes) == 2 and all(
        lane.n_generated > 0 for lane in loop.scheduler.lanes))
    _, chat = submit(loop, [500, 501, 502], 3, qos="interactive")
    drive(loop, engine, lambda: chat.token_ids, max_ticks=5)
    assert "paused" in agent.kinds()  # the text agent was preempted; the media lane never is


def test_an_urgent_media_request_may_take_the_last_lane(make):
    loop, engine = make(vision_engine(2), start=False, max_batch=2)
    with_image(loop, 1)
    drive(loop, engine, lambda: len(loop.scheduler.lanes) == 1)
    _, chat = with_image(loop, 2, qos="interactive", max_tokens=3)
    drive(loop, engine, lambda: chat.token_ids, max_ticks=5)


@pytest.mark.parametrize("urgent_lanes, admitted", [(0, 2), (1, 1)])
def test_urgent_lanes_zero_lets_media_take_every_lane(make, urgent_lanes, admitted):
    loop, engine = make(vision_engine(2), start=False, max_batch=2, extra={"urgent-lanes": urgent_lanes})
    for i in range(3):
        with_image(loop, i)
    step(loop, engine)
    assert len(lanes_of(loop, LaneState.PREFILLING)) + len(lanes_of(loop, LaneState.DECODING)) == admitted


def test_one_lane_is_anyones(make):
    loop, engine = make(vision_engine(1), start=False, max_batch=1)
    _, sink = with_image(loop, 1, max_tokens=3)
    drive(loop, engine, sink.done.is_set, max_ticks=10)
    assert sink.token_ids


class FailingImages(FakeEngine):
    """A fake engine whose image encoder fails: a lane whose feed holds an image ends with
    ``LaneResult.error``, as core's tick reports it (tests/unit/test_media_encoding.py)."""

    def execute(self, plan, feed=True):
        result = super().execute(plan, feed)
        for lp in plan.lanes:
            if lp.media:
                result.lanes[lp.slot] = LaneResult(slot=lp.slot, error="the image could not be encoded (boom)")
        return result


def test_an_image_that_fails_to_encode_fails_its_request_and_nothing_else(make):
    engine = FailingImages(max_lanes=2)
    engine.capabilities = attrs.evolve(engine.capabilities, vision=True)
    engine.info = attrs.evolve(engine.info, vision=VisionInfo(tile=2, rows=ROWS))
    loop, engine = make(engine, start=False, max_batch=2)
    _, text = submit(loop, [40, 41, 42], 30, qos="agent")
    _, broken = with_image(loop, 1, qos="agent")
    drive(loop, engine, lambda: text.done.is_set() and broken.done.is_set())
    assert broken.events[-1].kind == "error"
    err = broken.events[-1].error
    assert err.code == "image_encoding_failed" and "boom" in err.message
    assert text.events[-1].kind == "finished" and text.token_ids == expected_tokens(42, 30)
    assert engine.errors == [] and not loop.scheduler.lanes
