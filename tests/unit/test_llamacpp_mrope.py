"""plugins/llamacpp/mrope.py and embd_batch.py: M-RoPE positions computed by the engine, held to
what libmtmd itself writes, on the tiny Qwen2.5-VL and Qwen3-VL fixtures.

The engine cannot use ``mtmd_helper_eval_chunks`` (one lane a call, text and image together,
encode inside the tick); it decodes a lane's text as token rows and its images as embedding rows
in batches shared with other lanes. These tests decode a prompt that way, with
:class:`~superfluid.plugins.llamacpp.mrope.Positions`, and compare with libmtmd's own evaluation:

* the positions libmtmd puts in an image's batch (seen by its post-decode callback) are
  :meth:`Positions.rows`, and its next position is :meth:`Positions.next`;
* a prompt with two images and text between decoded the engine's way gives libmtmd's logits and
  greedy tokens; the same rows at one position a row (what the runner does today) do not;
* two lanes' image rows in one ``llama_decode`` (positions section-major across the batch) give
  each lane's tokens alone;
* a cut back to the end of an image, and a sequence's KV saved and restored into another slot,
  carry on to the same tokens (the KV keeps an image's row and column with its cells).
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from superfluid.plugins.llamacpp.embd_batch import EmbeddingBatch
from superfluid.plugins.llamacpp.mrope import N_POS, Grid, Positions
from tests import vlm_families_reference as ref
from tests.mtmd_session import MtmdSession

N_NEW = 6
SIZES = {"qwen2.5-vl": ((168, 84), (84, 168)), "qwen3-vl": ((192, 96), (96, 192))}


# ---- the mapping alone ---------------------------------------------------------------------------

def test_positions_lag_by_each_images_rows_less_its_positions():
    # 3 text, a 6 x 3 image (18 rows, 6 positions), 2 text, a 3 x 6 image, 1 text
    p = Positions([Grid(3, 6, 3), Grid(23, 3, 6)])
    assert [p.of(i) for i in (0, 2, 3, 20, 21, 22, 23, 40, 41)] == [0, 2, 3, 3, 9, 10, 11, 11, 17]
    assert p.next(3) == 3 and p.next(21) == 9 and p.next(42) == 18
    assert p.last(21) == 3 and p.last(22) == 9 and p.last(0) == -1
    assert p.snap(10) == 3 and p.snap(21) == 21 and p.snap(23) == 23 and p.snap(30) == 23
    with pytest.raises(ValueError):
        p.next(10)
    rows = p.rows(1, 24)  # text 1..2, the first image whole, text 21..22, the second image's first two rows
    assert rows.shape == (N_POS, 24)
    assert rows[:, 0].tolist() == [1, 1, 1, 0]
    assert rows[:, 2].tolist() == [3, 3, 3, 0]      # image row 0: (p0, p0, p0, 0)
    assert rows[:, 2 + 7].tolist() == [3, 4, 4, 0]  # image row 7 of a 6-wide grid: row 1, column 1
    assert rows[:, 2 + 17].tolist() == [3, 5, 8, 0]
    assert rows[:, 20].tolist() == [9, 9, 9, 0] and rows[:, 21].tolist() == [10, 10, 10, 0]
    assert rows[:, 22].tolist() == [11, 11, 11, 0] and rows[:, 23].tolist() == [11, 11, 12, 0]
    assert not rows[3].any()


def test_positions_without_images_are_token_indices():
    p = Positions()
    assert p.of(7) == 7 and p.next(7) == 7 and p.last(7) == 6 and p.snap(7) == 7
    assert p.rows(5, 3)[:3].tolist() == [[5, 6, 7]] * 3


def test_embedding_batch_lays_positions_out_section_major_across_lanes():
    b = EmbeddingBatch(8, 2, N_POS)
    b.add(np.ones((2, 2), np.float32), np.array([[0, 0], [1, 1], [2, 3], [0, 0]]), seq=0)
    b.add(np.ones((3, 2), np.float32), np.array([[5, 5, 5], [5, 6, 7], [5, 5, 5], [0, 0, 0]]), seq=1,
          logits_last=True)
    assert b.positions().tolist() == [0, 0, 5, 5, 5,  1, 1, 5, 6, 7,  2, 3, 5, 5, 5,  0, 0, 0, 0, 0]
    batch = b.batch()
    assert batch.n_tokens == 5 and [batch.seq_id[i][0] for i in range(5)] == [0, 0, 1, 1, 1]
    assert [batch.logits[i] for i in range(5)] == [0, 0, 0, 0, 1]


# ---- against libmtmd -----------------------------------------------------------------------------

@pytest.fixture(scope="module", params=list(SIZES))
def lane(request):
    family = request.param
    paths = ref.fixture(family)
    s = MtmdSession(str(paths["gguf"]), str(paths["mmproj"]), n_seq=2)
    yield family, s
    s.close()


def _image(rgb, size, seed: int | None = None):
    """A one-colour image, or with ``seed`` random pixels (rows that differ from each other, so
    that where each row sits shows in the logits)."""
    w, h = size
    if seed is None:
        return w, h, bytes(rgb) * (w * h)
    return w, h, np.random.default_rng(seed).integers(0, 256, w * h * 3, dtype=np.uint8).tobytes()


class Prompt:
    """A prompt tokenized by libmtmd, as the engine would hold it: the lane's tokens (text ids,
    a placeholder -1 per image row), each image's grid and rows."""

    def __init__(self, s: MtmdSession, text: str, images):
        self.chunks, self.desc = s.tokenize(text, images)
        self.tokens: list[int] = []
        self.grids: list[Grid] = []
        self.rows: dict[int, np.ndarray] = {}  # image start -> its embedding rows
        for i, c in enumerate(self.desc):
            if c.kind == "text":
                self.tokens += c.tokens
            else:
                g = Grid(len(self.tokens), c.nx, c.ny)
                self.grids.append(g)
                self.rows[g.start] = s.encode(self.chunks, i)
                self.tokens += [-1] * c.n_tokens
        self.positions = Positions(self.grids)

    def free(self, s: MtmdSession) -> None:
        s.mtmd.mtmd_input_chunks_free(self.chunks)


def _feed(s: MtmdSession, p: Prompt, seq: int, start: int = 0, *, one_position_a_row: bool = False) -> int:
    """Feed tokens ``start`` … of ``p`` to ``seq`` the engine's way: text runs as token batches at
    :meth:`Positions.of`, images as embedding batches at :meth:`Positions.rows` (or, with
    ``one_position_a_row``, at consecutive positions as today's runner does). The next position."""
    pos, i, n = p.positions, start, len(p.tokens)
    batch = EmbeddingBatch(512, s.n_embd_inp, N_POS)
    while i < n:
        if p.tokens[i] >= 0:
            j = i
            while j < n and p.tokens[j] >= 0:
                j += 1
            at = list(range(i, j)) if one_position_a_row else [pos.of(k) for k in range(i, j)]
            s.decode_tokens(p.tokens[i:j], at, seq)
            i = j
            continue
        g = next(g for g in p.grids if g.start == i)
        batch.clear()
        if one_position_a_row:
            at = np.tile(np.arange(i, g.end, dtype=np.int32), (N_POS, 1))
            at[3] = 0
        else:
            at = pos.rows(i, g.rows)
        batch.add(p.rows[g.start], at, seq, logits_last=g.end == n)
        assert s.ll.llama_decode(s.ctx, batch.batch()) == 0
        i = g.end
    return n if one_position_a_row else pos.next(n)


def test_image_positions_are_libmtmds(lane):
    family, s = lane
    for size in SIZES[family]:
        p = Prompt(s, f"Look{s.marker}", [_image((255, 0, 0), size)])
        try:
            s.clear()
            index = [c.kind for c in p.desc].index("image")
            n_text = len(p.desc[0].tokens)
            s.decode_tokens(p.desc[0].tokens, list(range(n_text)), 0)
            seen, next_pos = s.image_positions(p.chunks, index, n_text)
            [g] = p.grids
            assert seen.shape == (N_POS, g.rows)
            assert seen.tolist() == p.positions.rows(g.start, g.rows).tolist()
            assert next_pos == p.positions.next(g.end) == n_text + max(g.nx, g.ny)
        finally:
            p.free(s)


def _two_images(s: MtmdSession, family: str, first=(255, 0, 0), second=(0, 0, 255)) -> Prompt:
    wide, tall = SIZES[family]
    return Prompt(s, f"Compare{s.marker}with this{s.marker}now", [_image(first, wide, 1), _image(second, tall, 2)])


def test_engine_positions_decode_as_libmtmd_does(lane):
    family, s = lane
    p = _two_images(s, family)
    eos = ref.reference(family, "x", "y", (255, 0, 0), SIZES[family][0], 1).suppressed
    try:
        s.clear()
        n_past = s.eval_chunks(p.chunks)
        want_logits = s.logits()
        want = s.greedy(n_past, N_NEW, suppress=eos)

        s.clear()
        nxt = _feed(s, p, 0)
        assert nxt == n_past
        assert s.ll.llama_memory_seq_pos_max(s.mem, 0) == p.positions.last(len(p.tokens))
        np.testing.assert_allclose(s.logits(), want_logits, atol=1e-4)
        assert s.greedy(nxt, N_NEW, suppress=eos) == want

        s.clear()  # the same rows at one position a row, as the runner feeds SmolVLM's
        wrong = _feed(s, p, 0, one_position_a_row=True)
        assert np.abs(s.logits() - want_logits).max() > 1e-2
        assert wrong == len(p.tokens) > n_past
    finally:
        p.free(s)


def test_two_lanes_images_in_one_decode(lane):
    """Lane 0's prompt and lane 1's (other colours, other text length) fed side by side: every
    image step carries both lanes' rows in one embedding batch."""
    family, s = lane
    a = _two_images(s, family)
    b = Prompt(s, f"A longer question about{s.marker}", [_image((0, 160, 0), SIZES[family][1])])
    eos = ref.reference(family, "x", "y", (255, 0, 0), SIZES[family][0], 1).suppressed
    try:
        alone = []
        for p in (a, b):
            s.clear()
            alone.append(s.greedy(s.eval_chunks(p.chunks), N_NEW, suppress=eos))

        s.clear()
        # text up to each lane's first image, then both first images in one batch
        firsts = {0: a.grids[0], 1: b.grids[0]}
        for seq, p in ((0, a), (1, b)):
            s.decode_tokens(p.tokens[:firsts[seq].start], [p.positions.of(k) for k in range(firsts[seq].start)], seq)
        batch = EmbeddingBatch(512, s.n_embd_inp, N_POS)
        for seq, p in ((0, a), (1, b)):
            g = firsts[seq]
            batch.add(p.rows[g.start], p.positions.rows(g.start, g.rows), seq)
        assert s.ll.llama_decode(s.ctx, batch.batch()) == 0
        # then each lane's rest (lane 0: text, its second image, text; lane 1: the text after)
        for seq, p in ((0, a), (1, b)):
            nxt = _feed(s, p, seq, start=firsts[seq].end)
            assert s.greedy(nxt, N_NEW, seq=seq, suppress=eos) == alone[seq]
    finally:
        a.free(s)
        b.free(s)


def test_cut_back_to_an_image_and_restore_a_parked_lane(lane):
    family, s = lane
    p = _two_images(s, family)
    eos = ref.reference(family, "x", "y", (255, 0, 0), SIZES[family][0], 1).suppressed
    ll = s.ll
    try:
        s.clear()
        nxt = _feed(s, p, 0)
        want = s.greedy(nxt, N_NEW, suppress=eos)

        # cut back into the second image: the cut snaps to its start, the KV ends where the text
        # before it ends, and feeding the rest again gives the same tokens
        g = p.grids[1]
        keep = p.positions.snap(g.start + 5)
        assert keep == g.start
        assert ll.llama_memory_seq_rm(s.mem, 0, p.positions.of(keep), -1)
        assert ll.llama_memory_seq_pos_max(s.mem, 0) == p.positions.last(keep)
        assert s.greedy(_feed(s, p, 0, start=keep), N_NEW, suppress=eos) == want

        # park: save lane 0's KV, restore it into slot 1, carry on there at the next position
        s.clear()
        nxt = _feed(s, p, 0)
        size = ll.llama_state_seq_get_size(s.ctx, 0)
        buf = (ctypes.c_uint8 * size)()
        assert ll.llama_state_seq_get_data(s.ctx, buf, size, 0) == size
        s.decode_tokens([want[0]], [nxt], 0)  # lane 0 moves on, so slot 1's tokens are its own
        assert ll.llama_state_seq_set_data(s.ctx, buf, size, 1) > 0
        assert ll.llama_memory_seq_pos_max(s.mem, 1) == p.positions.last(len(p.tokens))
        s.decode_tokens([want[0]], [nxt], 1)
        assert [want[0]] + s.greedy(nxt + 1, N_NEW - 1, seq=1, suppress=eos) == want
    finally:
        p.free(s)
