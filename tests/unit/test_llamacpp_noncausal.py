"""plugins/llamacpp/noncausal.py: Gemma 3's image steps (non-causal attention) beside other lanes,
on the tiny Gemma 3 fixture, against libmtmd's own evaluation of each lane alone (which
test_vlm_families_llamacpp.py holds to transformers).

* Two lanes' images in one non-causal ``llama_decode`` give each lane's logits (within 1e-4) and
  tokens alone; decoded causally the logits move (the setting matters).
* A text lane that sits out the image step and decodes in the next gives its tokens alone: it
  loses the step, nothing else.
* An image split across two steps (as today's image step splits one when room runs out), or
  beside an image of another length in one step (llama.cpp then splits the batch unevenly), gives
  other logits; a non-causal step longer than ``n_ubatch`` aborts the process (llama.cpp asserts
  it). :func:`pick_images` asks for none of these.
* Causal attention is back on after an image step that failed.
"""

from __future__ import annotations

import numpy as np
import pytest

from superfluid.plugins.llamacpp.embd_batch import EmbeddingBatch
from superfluid.plugins.llamacpp.noncausal import next_step_is_images, non_causal_attention, pick_images
from tests import vlm_families_reference as ref
from tests.mtmd_session import MtmdSession

N_NEW = 6
TILE = 64


def _image(seed: int):
    return TILE, TILE, np.random.default_rng(seed).integers(0, 256, TILE * TILE * 3, dtype=np.uint8).tobytes()


class Lane:
    """A Gemma 3 prompt ``<text> <image> <text>`` tokenized by libmtmd: the text before and after
    the image, and the image's rows."""

    def __init__(self, s: MtmdSession, before: str, seed: int):
        chunks, desc = s.tokenize(f"{before}\n\n{s.marker}\n\nwhat is it", [_image(seed)])
        try:
            kinds = [c.kind for c in desc]
            assert kinds == ["text", "image", "text"]
            self.before, self.after = desc[0].tokens, desc[2].tokens
            self.rows = s.encode(chunks, 1)
            s.clear()
            n_past = s.eval_chunks(chunks)
            self.alone_logits = s.logits()  # at the prompt's end
            self.alone = s.greedy(n_past, N_NEW, suppress=_eos())
        finally:
            s.mtmd.mtmd_input_chunks_free(chunks)

    @property
    def image_at(self) -> int:
        return len(self.before)

    @property
    def end(self) -> int:
        return len(self.before) + len(self.rows) + len(self.after)


def _eos() -> tuple[int, ...]:
    return ref.reference("gemma3", "x", "y", (255, 0, 0), (TILE, TILE), 1).suppressed


def _session(**kw) -> MtmdSession:
    paths = ref.fixture("gemma3")
    return MtmdSession(str(paths["gguf"]), str(paths["mmproj"]), n_seq=2, **kw)


@pytest.fixture(scope="module")
def gemma():
    s = _session()
    yield s
    s.close()


def _image_step(s: MtmdSession, lanes: dict[int, Lane], *, causal: bool = False) -> None:
    batch = EmbeddingBatch(64, s.n_embd_inp)
    for seq, lane in lanes.items():
        batch.add(lane.rows, np.arange(lane.image_at, lane.image_at + len(lane.rows)), seq)
    if causal:
        assert s.ll.llama_decode(s.ctx, batch.batch()) == 0
        return
    with non_causal_attention(s.ctx):
        assert s.ll.llama_decode(s.ctx, batch.batch()) == 0


def _finish(s: MtmdSession, lane: Lane, seq: int) -> list[int]:
    """Feed the text after the image and decode greedily; the lane's logits at the prompt's end
    are kept in ``lane.logits``."""
    start = lane.image_at + len(lane.rows)
    s.decode_tokens(lane.after, list(range(start, lane.end)), seq)
    lane.logits = s.logits()
    return s.greedy(lane.end, N_NEW, seq=seq, suppress=_eos())


def _off(lane: Lane) -> float:
    """How far the lane's logits at the prompt's end are from libmtmd's alone."""
    return float(np.abs(lane.logits - lane.alone_logits).max())


def test_two_lanes_images_in_one_non_causal_step(gemma):
    s = gemma
    a, b = Lane(s, "Describe", 1), Lane(s, "Tell me about this", 2)
    assert a.alone != b.alone
    for causal in (False, True):
        s.clear()
        for seq, lane in ((0, a), (1, b)):
            s.decode_tokens(lane.before, list(range(lane.image_at)), seq)
        _image_step(s, {0: a, 1: b}, causal=causal)
        got = [_finish(s, a, 0), _finish(s, b, 1)]
        if causal:  # the image rows must see each other: decoded causally the logits move
            assert min(_off(a), _off(b)) > 1e-2
        else:
            assert max(_off(a), _off(b)) < 1e-4
            assert got == [a.alone, b.alone]


def test_a_text_lane_loses_the_image_step_and_nothing_else(gemma):
    s = gemma
    a = Lane(s, "Describe", 1)
    text_chunks, desc = s.tokenize("Write a short poem about the sea", [])
    prompt = desc[0].tokens
    s.mtmd.mtmd_input_chunks_free(text_chunks)
    s.clear()
    s.decode_tokens(prompt, list(range(len(prompt))), 1)
    alone_text = s.greedy(len(prompt), N_NEW, seq=1, suppress=_eos())

    s.clear()
    s.decode_tokens(prompt, list(range(len(prompt))), 1)
    first = int(np.where(np.isin(np.arange(s.n_vocab), _eos()), -np.inf, s.logits()).argmax())
    s.decode_tokens(a.before, list(range(a.image_at)), 0)
    _image_step(s, {0: a})  # lane 1 sits this step out
    got_a = _finish(s, a, 0)
    assert _off(a) < 1e-4
    s.decode_tokens([first], [len(prompt)], 1)  # lane 1's next step
    got_text = [first] + s.greedy(len(prompt) + 1, N_NEW - 1, seq=1, suppress=_eos())
    assert got_a == a.alone
    assert got_text == alone_text


def _halves(lane: Lane) -> tuple[Lane, Lane]:
    """The lane's image as two pieces fed one after the other (first half, second half)."""
    half = len(lane.rows) // 2
    first, second = Lane.__new__(Lane), Lane.__new__(Lane)
    first.before, first.rows = lane.before, lane.rows[:half]
    second.before, second.rows = lane.before + [0] * half, lane.rows[half:]
    return first, second


def test_an_image_split_across_steps_goes_wrong(gemma):
    """What today's image step does when room runs out (it feeds the rows that fit and the rest
    next step) is wrong under non-causal attention: the first rows never see the last."""
    s = gemma
    b = Lane(s, "Tell me about this", 2)
    s.clear()
    s.decode_tokens(b.before, list(range(b.image_at)), 1)
    first, second = _halves(b)
    _image_step(s, {1: first})
    _image_step(s, {1: second})
    _finish(s, b, 1)
    assert _off(b) > 1e-2


def test_images_of_different_lengths_in_one_step_go_wrong(gemma):
    """With a KV per sequence llama.cpp splits a batch equally: lane 0's 16 rows beside lane 1's
    8 go as 8 + 8, then lane 0's last 8, so lane 0's image is cut in two although the step fits
    ``n_ubatch``. Hence :func:`pick_images` takes images of one row count a step."""
    s = gemma
    a, b = Lane(s, "Describe", 1), Lane(s, "Tell me about this", 2)
    s.clear()
    for seq, lane in ((0, a), (1, b)):
        s.decode_tokens(lane.before, list(range(lane.image_at)), seq)
    first, _ = _halves(b)
    _image_step(s, {0: a, 1: first})
    _finish(s, a, 0)
    assert _off(a) > 1e-2
    assert pick_images([(0, len(a.rows)), (1, len(first.rows))], 512) == [0]


_ABORT = """
import sys
sys.path.insert(0, {root!r})
import numpy as np
from superfluid.plugins.llamacpp.embd_batch import EmbeddingBatch
from superfluid.plugins.llamacpp.noncausal import non_causal_attention
from tests.mtmd_session import MtmdSession
s = MtmdSession({gguf!r}, {mmproj!r}, n_seq=2, n_ubatch=24)
batch = EmbeddingBatch(64, s.n_embd_inp)
for seq in (0, 1):
    batch.add(np.zeros((16, s.n_embd_inp), np.float32), np.arange(16), seq)
with non_causal_attention(s.ctx):
    s.ll.llama_decode(s.ctx, batch.batch())
print("decoded")
"""


def test_a_non_causal_step_longer_than_n_ubatch_aborts_the_worker():
    """llama.cpp asserts that a non-causal decode fits one micro-batch: two 16-row images with
    ``n_ubatch`` 24 abort the process (here a child process). :func:`pick_images` keeps a step
    within ``n_ubatch``: one image at a time there."""
    import signal
    import subprocess
    import sys
    from pathlib import Path

    paths = ref.fixture("gemma3")
    root = str(Path(__file__).resolve().parents[2])
    code = _ABORT.format(root=root, gguf=str(paths["gguf"]), mmproj=str(paths["mmproj"]))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=root)
    assert done.returncode == -signal.SIGABRT, done.stdout + done.stderr[-2000:]
    assert "non-causal attention requires n_ubatch >= n_tokens" in done.stderr
    assert pick_images([(0, 16), (1, 16)], 24) == [0]


def test_causal_attention_comes_back_after_a_failed_image_step(gemma):
    s = gemma
    a = Lane(s, "Describe", 1)
    with pytest.raises(RuntimeError):
        with non_causal_attention(s.ctx):
            raise RuntimeError("llama_decode failed")
    # were attention still non-causal, this lane's own prompt (text, image, text) would decode
    # its text rows seeing later ones
    s.clear()
    s.decode_tokens(a.before, list(range(a.image_at)), 0)
    _image_step(s, {0: a})
    assert _finish(s, a, 0) == a.alone
    assert _off(a) < 1e-4


def test_pick_images():
    assert pick_images([], 512) == []
    assert pick_images([(3, 256), (1, 256), (2, 256)], 512) == [3, 1]
    assert pick_images([(0, 16), (1, 32), (2, 16)], 512) == [0, 2]  # one row count a step
    with pytest.raises(ValueError):
        pick_images([(0, 256)], 128)


def test_image_steps_never_run_twice_in_a_row_while_text_waits():
    assert next_step_is_images(True, True, last_was_images=False)
    assert not next_step_is_images(True, True, last_was_images=True)
    assert next_step_is_images(True, False, last_was_images=True)
    assert not next_step_is_images(False, True, last_was_images=False)
