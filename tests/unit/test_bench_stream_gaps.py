"""tools/bench/stream_gaps.py's summary: the gaps between content deltas, and beside them the
gaps between the chunks that carry tokens (``--token-events``), which a token without text
(no content delta) does not stretch across two ticks."""

from __future__ import annotations

from tools.bench import stream_gaps


def _stream(gaps, token_gaps, deltas, tokens):
    return {"ttft_s": 0.1, "gaps_s": gaps, "deltas": deltas, "completion_tokens": tokens,
            "token_gaps_s": token_gaps, "token_events": None if token_gaps is None else len(token_gaps) + 1}


def test_a_silent_token_stretches_the_content_gap_but_not_the_gap_between_tokens():
    runs = [{"streams": [_stream([0.3, 0.35, 0.3], [0.3, 0.35, 0.3], 4, 4),
                         _stream([0.3, 0.94, 0.3], [0.3, 0.31, 0.32, 0.31, 0.3], 4, 6)],  # two silent tokens
             "arrivals": [{"ttft_s": 2.0}]}]
    s = stream_gaps.summarize(runs)
    assert s["gaps"]["max"] == 0.94
    assert s["token_gaps"]["max"] == 0.35 and s["token_gaps"]["gaps"] == 8
    row = stream_gaps.table({"t": {2: s}}, [2]).splitlines()[-1]
    assert "| 0.940 |" in row and "0.350 / 0.350" in row


def test_without_token_events_the_token_columns_are_empty():
    s = stream_gaps.summarize([{"streams": [_stream([0.3, 0.4], None, 3, 3)], "arrivals": []}])
    assert s["token_gaps"] is None and s["gaps"]["max"] == 0.4
    assert "- / -" in stream_gaps.table({"t": {1: s}}, [1]).splitlines()[-1]
