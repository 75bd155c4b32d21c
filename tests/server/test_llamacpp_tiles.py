"""Split images on llama.cpp, driven with tick plans as the scheduler drives them: a real worker
process (``WorkerProcess`` over the worker's ``main``) serving the tiny SmolVLM's GGUF and mmproj
(tools/fixtures/tiny_vlm.py), each prompt laid out by our layout and checked equal to
transformers' processor (tests/vision_reference.py's ``prompt``).

A red image at a wide and a blue at a tall aspect ratio (2 × 4 and 4 × 2 tiles plus the global
image): greedy tokens equal transformers' ``generate``; the two image lanes fed in one tick (their
image rows in the same decode) give what each gives alone; a prompt cut inside the tiles, tick by
tick, gives the same tokens."""

from __future__ import annotations

import pytest

from superfluid.core.media import spans_within
from superfluid.core.request import SamplingParams
from superfluid.core.tick import LanePlan, TickPlan
from superfluid.core.worker_process import WorkerProcess
from superfluid.plugins.llamacpp.extra_buffers import choose
from superfluid.plugins.llamacpp.worker import WorkerSpec, main
from tests import vision_reference as ref
from tools.fixtures.tiny_vlm import ROWS, build

pytest.importorskip("transformers")

GREEDY = SamplingParams(temperature=0.0)
N = 8
RED, BLUE = (255, 0, 0), (0, 0, 255)
BEFORE, AFTER = "<|im_start|>User:", " What colour is this?\nAssistant:"


@pytest.fixture(scope="module")
def vlm():
    return build()


@pytest.fixture(scope="module")
def tick(vlm):
    """A worker encoding on the tick thread, so that a tick's image step is the one that feeds
    the rows (the background encoder is tests/unit/test_media_encoding.py's and
    test_media_lanes.py's)."""
    process = WorkerProcess("vlm")
    spec = WorkerSpec(path=str(vlm["gguf"]), max_lanes=4, max_context=512, threads=2,
                      extra_buffers=choose("auto").use, mmproj=str(vlm["mmproj"]), image_rows=ROWS,
                      image_encoding="tick")
    process.start(main, spec, name="test-llamacpp-tiles")
    yield lambda plan: process.call(("tick", plan))
    process.close()


def _lane(hf: str, rgb, size):
    return ref.prompt(hf, BEFORE, [ref.solid(rgb, size)], AFTER)


def generate(tick, lanes: dict, *, chunk: int = 0, ticks: list | None = None) -> dict[int, list[int]]:
    """Greedy tokens per slot: each prompt (``chunk`` tokens a tick if set, each feed with the
    spans it touches), then one token a tick, ``N`` in all whatever they are."""
    out = {s: [] for s in lanes}
    pos = {s: 0 for s in lanes}

    def prefill(slot):
        tokens, spans = lanes[slot]
        start = pos[slot]
        end = len(tokens) if not chunk else min(len(tokens), start + chunk)
        return LanePlan(slot=slot, pos=start, feed=tokens[start:end], sample=end == len(tokens), max_new=1,
                        reset=start == 0, sampling=GREEDY if start == 0 else None, ignore_eos=True,
                        media=spans_within(spans, start, end))

    plans = [prefill(s) for s in lanes]
    while plans:
        res = tick(TickPlan(lanes=plans))
        if ticks is not None:
            ticks.append(res)
        nxt = []
        for lp in plans:
            lr = res.lanes[lp.slot]
            out[lp.slot] += lr.tokens
            pos[lp.slot] += lr.n_fed
            if pos[lp.slot] < len(lanes[lp.slot][0]):
                nxt.append(prefill(lp.slot))
            elif len(out[lp.slot]) < N:
                nxt.append(LanePlan(slot=lp.slot, pos=pos[lp.slot], feed=[out[lp.slot][-1]], sample=True, max_new=1,
                                    decode=True, ignore_eos=True))
        plans = nxt
    tick(TickPlan(release=list(lanes)))
    return out


def test_wide_red_and_tall_blue_equal_transformers_together_and_alone(tick, vlm):
    hf = str(vlm["hf"])
    lanes = {0: _lane(hf, RED, ref.WIDE), 1: _lane(hf, BLUE, ref.TALL)}
    assert [len(spans) for _, spans in lanes.values()] == [9, 9]
    ticks: list = []
    together = generate(tick, lanes, ticks=ticks)
    first = ticks[0].lanes
    assert first[0].n_prefill == len(lanes[0][0]) and first[1].n_prefill == len(lanes[1][0])  # one tick
    assert ticks[0].encoded == 2
    for slot, (tokens, spans) in lanes.items():
        assert together[slot] == generate(tick, {2: (tokens, spans)})[2], slot
        assert together[slot] == ref.greedy(hf, tokens, spans, N), slot
    assert together[0] != generate(tick, {2: _lane(hf, BLUE, ref.WIDE)})[2]  # the colour counts


def test_a_prompt_cut_inside_the_tiles_gives_the_same_tokens(tick, vlm):
    """Ticks of 3 tokens: every tile's 4 rows are cut, and tiles' rows meet text tokens in one feed."""
    hf = str(vlm["hf"])
    lane = _lane(hf, BLUE, ref.TALL)
    assert generate(tick, {0: lane}, chunk=3) == generate(tick, {0: lane})
