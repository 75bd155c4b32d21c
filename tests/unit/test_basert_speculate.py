"""plugins/basert/speculate.py: prompt-lookup drafts, greedy verification and the gate."""

from __future__ import annotations

import time

import numpy as np
import pytest

from superfluid.plugins.basert.speculate import Gate, propose, verify


@pytest.mark.parametrize("history, k, want", [
    ([1, 2, 3, 4, 1, 2, 3], 2, [4, 1]),  # the 3-gram (1 2 3) was followed by 4, 1
    ([1, 2, 3, 4, 5], 3, []),  # nothing repeats
    ([7], 3, []),
    ([], 3, []),
    ([5, 9, 1, 2, 8, 2], 3, [8, 2]),  # only the 1-gram (2) repeats
    ([1, 2, 3, 2, 3, 9, 9, 1, 2, 3], 4, [2, 3, 9, 9]),  # the 3-gram (1 2 3) beats the later 2-gram (2 3)
    ([4, 2, 3, 7, 0, 2, 3, 8, 6, 2, 3], 2, [8, 6]),  # the most recent earlier (2 3) wins
    ([1, 2, 3, 4, 5, 6, 1, 2, 3], 2, [4, 5]),  # cut at k
    ([1, 2, 3, 4, 1, 2, 3], 10, [4, 1, 2, 3]),  # up to what follows, the suffix included
    ([3, 3, 3], 2, [3]),  # an overlapping earlier occurrence
])
def test_propose_drafts_what_followed_the_longest_most_recent_match(history, k, want):
    assert propose(history, k) == want
    assert propose(np.asarray(history, dtype=np.int64), k) == want


def test_propose_respects_the_ngram_bounds():
    history = [5, 9, 1, 2, 8, 2]
    assert propose(history, 3, ngram_min=2) == []  # only a 1-gram repeats
    assert propose([1, 2, 3, 4, 1, 2, 3], 2, ngram_max=1) == [4, 1]  # the 1-gram (3) alone
    assert propose([1, 2, 3], 0) == []


def test_propose_is_cheap_on_an_8k_history(capsys):
    rng = np.random.default_rng(1)
    history = rng.integers(0, 50_000, size=8192).tolist()
    history += history[1000:1003]  # a match to find
    array = np.asarray(history, dtype=np.int64)
    timings = {}
    for name, call in [("list", lambda: propose(history, 4)), ("array", lambda: propose(array, 4))]:
        assert call() == history[1003:1007]
        start = time.perf_counter()
        for _ in range(200):
            call()
        timings[name] = (time.perf_counter() - start) / 200 * 1e6
    with capsys.disabled():
        print(f"\npropose on 8k tokens: {timings['list']:.0f} us (list), {timings['array']:.0f} us (array)")
    assert timings["array"] < 1000  # loose: a shared CI machine


@pytest.mark.parametrize("draft, greedy, want", [
    ([4, 5, 6], [4, 5, 6, 7], [4, 5, 6, 7]),  # all accepted, plus the model's next
    ([4, 5, 6], [4, 9, 6, 7], [4, 9]),  # the first disagreement is the model's token
    ([4, 5, 6], [8, 5, 6, 7], [8]),  # nothing accepted: still one token
    ([], [3], [3]),
])
def test_verify_emits_what_decoding_without_a_draft_would(draft, greedy, want):
    assert verify(draft, greedy) == want


def test_verify_wants_one_more_pick_than_the_draft():
    with pytest.raises(ValueError):
        verify([1, 2], [1, 2])


def test_the_gate_turns_off_under_load():
    gate = Gate(4, max_lanes=4)
    assert gate.draft_len(0, n_decoding=1) == 4
    assert gate.draft_len(0, n_decoding=4) == 4
    assert gate.draft_len(0, n_decoding=5) == 0
    assert Gate(0).draft_len(0, 1) == 0


def test_a_lane_with_low_acceptance_stops_then_reprobes():
    gate = Gate(4, min_acceptance=0.3, probe_every=5)
    for _ in range(4):  # EMA 1.0 -> 0.7, 0.49, 0.34, 0.24
        assert gate.draft_len(1, 1) == 4
        gate.record(1, 4, 0)
    assert not gate.active(1)
    assert gate.draft_len(2, 1) == 4  # other lanes are not affected
    lens = [gate.draft_len(1, 1) for _ in range(10)]
    assert lens == [0, 0, 0, 0, 4, 0, 0, 0, 0, 4]
    gate.record(1, 4, 4)  # a probe that pays
    gate.record(1, 4, 4)
    assert gate.active(1) and gate.draft_len(1, 1) == 4
    gate.forget(1)
    assert gate.active(1)


def test_gate_totals():
    gate = Gate(4)
    gate.record(0, 4, 3)
    gate.record(1, 4, 1)
    gate.record(1, 0, 0)  # nothing drafted: not a verify step
    assert (gate.drafted, gate.accepted, gate.verify_steps) == (8, 4, 2)
    assert gate.acceptance_rate == 0.5
    assert Gate(4).acceptance_rate == 0.0
