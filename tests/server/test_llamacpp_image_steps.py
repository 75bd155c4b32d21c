"""Gemma 3's image steps on llama.cpp, driven with tick plans as the scheduler drives them: a real
worker process (``WorkerProcess`` over the worker's ``main``) serving the tiny Gemma 3's or Qwen2.5-VL's
GGUF and mmproj (tools/fixtures/), encoding on the tick thread so a tick's steps are
what this test sees.

- Two lanes' images go whole in one non-causal step (both images' rows, nothing else), between
  the text steps before and after them, and each lane's tokens equal what it gives alone.
- A lane that decodes beside an image too long for one step (Qwen2.5-VL's, 600 rows) loses one
  step to each image step, never two in a row; the image lane's tokens equal what it gives alone.
"""

from __future__ import annotations

import pytest

from superfluid.core.media import Image, grids, spans_within
from superfluid.core.request import SamplingParams
from superfluid.core.tick import LanePlan, TickPlan
from superfluid.core.worker_process import WorkerProcess
from superfluid.plugins.llamacpp import vision
from superfluid.plugins.llamacpp.extra_buffers import choose
from superfluid.plugins.llamacpp.worker import WorkerSpec, main
from tests import vlm_families_reference as ref

pytest.importorskip("transformers")

GREEDY = SamplingParams(temperature=0.0)
RED, BLUE, GREEN = (255, 0, 0), (0, 0, 255), (0, 160, 0)


@pytest.fixture(scope="module")
def gemma():
    return ref.fixture("gemma3")


@pytest.fixture(scope="module")
def tick(gemma):
    process = WorkerProcess("gemma3")
    spec = WorkerSpec(path=str(gemma["gguf"]), max_lanes=4, max_context=512, threads=2,
                      extra_buffers=choose("auto").use, mmproj=str(gemma["mmproj"]), image_encoding="tick")
    process.start(main, spec, name="test-llamacpp-image-steps")
    yield lambda plan: process.call(("tick", plan))
    process.close()


@pytest.fixture(scope="module")
def layout(gemma):
    tok = ref.processor("gemma3").tokenizer

    def token_id(text: str):
        ids = tok.encode(text, add_special_tokens=False)
        return ids[0] if len(ids) == 1 else None

    return vision.vision_info("gemma3", str(gemma["mmproj"]), token_id)


def _text(text: str) -> list[int]:
    return ref.processor("gemma3").tokenizer.encode(text, add_special_tokens=False)


def _prompt(layout, parts: list) -> tuple[list[int], tuple]:
    """Tokens and spans of ``parts`` (text, or an (r, g, b) image stretched to the tile)."""
    tokens: list[int] = []
    spans: list = []
    for part in parts:
        if isinstance(part, str):
            tokens += _text(part)
            continue
        t = layout.tile
        laid, placed = layout.place(Image.from_rgb(t, t, bytes(part) * (t * t)), len(tokens))
        tokens += laid
        spans += placed
    return tokens, tuple(spans)


def _prefill(slot: int, prompt, max_new: int) -> LanePlan:
    tokens, spans = prompt
    return LanePlan(slot=slot, pos=0, feed=list(tokens), sample=True, max_new=max_new, reset=True, sampling=GREEDY,
                    ignore_eos=True, media=spans_within(spans, 0, len(tokens)))


def test_two_lanes_images_go_whole_in_one_step_and_equal_each_alone(tick, layout):
    prompts = {0: _prompt(layout, ["Describe\n\n", RED, "\n\nplease"]),
               1: _prompt(layout, ["Tell me about\n\n", BLUE, "\n\nnow"])}
    alone = {}
    for slot, prompt in prompts.items():
        alone[slot] = tick(TickPlan(lanes=[_prefill(slot, prompt, 1)])).lanes[slot].tokens
    res = tick(TickPlan(lanes=[_prefill(slot, prompt, 1) for slot, prompt in prompts.items()]))
    assert {slot: res.lanes[slot].tokens for slot in prompts} == alone
    rows = layout.rows
    before = [len(_text("Describe\n\n")), len(_text("Tell me about\n\n"))]
    after = [len(_text("\n\nplease")) + 1, len(_text("\n\nnow")) + 1]  # (+ <end_of_image>)
    assert [(s.prefill_tokens, s.decode_tokens) for s in res.steps] == [
        (sum(before) + 2, 0), (2 * rows, 0), (sum(after), 0)]  # (+ <start_of_image> each)


@pytest.fixture(scope="module")
def qwen_tick():
    paths = ref.fixture("qwen2.5-vl")
    process = WorkerProcess("qwen")
    spec = WorkerSpec(path=str(paths["gguf"]), max_lanes=4, max_context=1024, threads=2,
                      extra_buffers=choose("auto").use, mmproj=str(paths["mmproj"]), image_encoding="tick")
    process.start(main, spec, name="test-llamacpp-image-steps-qwen")
    tok = ref.processor("qwen2.5-vl").tokenizer

    def token_id(text: str):
        ids = tok.encode(text, add_special_tokens=False)
        return ids[0] if len(ids) == 1 else None

    yield (lambda plan: process.call(("tick", plan))), vision.vision_info("qwen", str(paths["mmproj"]), token_id), tok
    process.close()


def test_a_decoding_lane_loses_one_step_to_an_image_step_never_two_in_a_row(qwen_tick):
    """A Qwen image of 600 rows (24 × 25 merged patches) takes two image steps (n_ubatch 512);
    a lane decoding beside it gets its token in a text step between them, and the image lane's
    tokens (its rows placed by M-RoPE over two steps) equal what it gives alone."""
    tick, layout, tok = qwen_tick
    w, h = 24 * 28, 25 * 28
    laid, spans = layout.place(Image.from_rgb(w, h, bytes(GREEN) * (w * h)), len(tok.encode("Compare")))
    tokens = tok.encode("Compare") + laid + tok.encode(" please")
    assert spans[0].rows == 600 and spans[0].grid == (24, 25)

    def image_lane(slot: int) -> LanePlan:
        return LanePlan(slot=slot, pos=0, feed=list(tokens), sample=True, max_new=4, reset=True, sampling=GREEDY,
                        ignore_eos=True, media=spans, grids=grids(spans))

    alone = tick(TickPlan(lanes=[image_lane(1)])).lanes[1].tokens
    text_lane = tok.encode("Write a long story about a lighthouse.")
    first = tick(TickPlan(lanes=[LanePlan(slot=0, pos=0, feed=text_lane, sample=True, max_new=1, reset=True,
                                          sampling=GREEDY, ignore_eos=True)])).lanes[0].tokens
    res = tick(TickPlan(lanes=[
        LanePlan(slot=0, pos=len(text_lane), feed=[first[-1]], sample=True, max_new=12, decode=True, ignore_eos=True),
        image_lane(2)]))
    kinds = ["image" if s.decode_tokens == 0 and s.prefill_tokens in (512, 88) else "text" for s in res.steps]
    assert kinds.count("image") == 2 and "image,image" not in ",".join(kinds), kinds
    assert all(s.decode_tokens >= 1 for s, k in zip(res.steps, kinds) if k == "text")  # its token in each
    assert len(res.lanes[0].tokens) == 12
    assert res.lanes[2].tokens == alone
