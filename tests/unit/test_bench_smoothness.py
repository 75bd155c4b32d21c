"""Stream smoothness (tools/bench/smoothness.py): the gaps between a stream's deltas and their
nearest-rank percentiles, pooled over streams, with the worst stream's p99 kept apart, on
synthetic arrival instants."""

from __future__ import annotations

import pytest

from tools.bench import smoothness


def test_gaps_are_consecutive_differences():
    assert smoothness.gaps([10.0, 10.5, 10.75, 12.0]) == [0.5, 0.25, 1.25]
    assert smoothness.gaps([3.0]) == [] and smoothness.gaps([]) == []


def test_percentile_is_nearest_rank():
    values = [float(v) for v in range(1, 101)]  # 1 .. 100, shuffled order must not matter
    values.reverse()
    assert smoothness.percentile(values, 0.50) == 50.0
    assert smoothness.percentile(values, 0.99) == 99.0
    assert smoothness.percentile(values, 1.0) == 100.0
    assert smoothness.percentile(values, 0.0) == 1.0
    assert smoothness.percentile([4.0, 1.0, 3.0, 2.0], 0.5) == 2.0  # a measured gap, not 2.5
    assert smoothness.percentile([7.0], 0.99) == 7.0
    assert smoothness.percentile([], 0.5) is None
    with pytest.raises(ValueError):
        smoothness.percentile([1.0], 1.5)


def test_summary_pools_streams_and_keeps_the_worst_stream_apart():
    # Stream a: 149 even gaps of 10 ms, then one 500 ms stall. Stream b: 50 gaps of 20 ms.
    # Stream c: one delta only (no gap): it must not count as a stream.
    a = [i * 0.010 for i in range(150)] + [1.49 + 0.5]
    b = [i * 0.020 for i in range(51)]
    s = smoothness.summarize([smoothness.gaps(a), smoothness.gaps(b), smoothness.gaps([1.0])])
    assert s.streams == 2 and s.gaps == 200
    assert s.p50 == pytest.approx(0.010)  # rank 100 of 200: the 149 gaps of 10 ms
    assert s.p99 == pytest.approx(0.020)  # the stall is 1 in 200: past the pooled p99 (rank 198)
    assert s.max == pytest.approx(0.5)
    # a's own p99 is rank 149 of 150 (10 ms), b's rank 50 of 50 (20 ms)
    assert s.worst_stream_p99 == pytest.approx(0.020)
    # with fewer gaps the stall is inside the stream's p99, and the pooled p99 would hide it
    short = [0.0, 0.01, 0.02, 0.52]
    s = smoothness.summarize([smoothness.gaps(short)] + [smoothness.gaps(b)] * 3)
    assert s.worst_stream_p99 == pytest.approx(0.5)
    assert s.p99 == pytest.approx(0.020)
    assert s.to_json()["worst_stream_p99"] == pytest.approx(0.5)


def test_no_gaps_give_no_summary():
    assert smoothness.summarize([]) is None
    assert smoothness.summarize([[], []]) is None
