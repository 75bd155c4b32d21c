"""tools/bench/stream_gaps.py's summary: the largest gap of the streams whose every token had
text, apart from those where a token without text (no delta) made a gap span two ticks."""

from __future__ import annotations

from tools.bench import stream_gaps


def _stream(gaps, deltas, tokens):
    return {"ttft_s": 0.1, "gaps_s": gaps, "deltas": deltas, "completion_tokens": tokens}


def test_streams_with_silent_tokens_are_left_out_of_the_all_text_max():
    runs = [{"streams": [_stream([0.3, 0.35, 0.3], 4, 4),          # every token a delta
                         _stream([0.3, 0.36, 0.3], 4, 5),          # one silent (the first): kept
                         _stream([0.3, 0.94, 0.3], 4, 7)],         # three silent: a 3-tick gap
             "arrivals": [{"ttft_s": 2.0}]}]
    s = stream_gaps.summarize(runs)
    assert s["gaps"]["max"] == 0.94                                 # every gap still counts here
    assert s["max_gap_all_text_s"] == 0.36
    assert s["streams_with_silent_tokens"] == 1
    row = stream_gaps.table({"t": {2: s}}, [2]).splitlines()[-1]
    assert "0.940" in row and "0.360 (1 left out)" in row
