"""The chaos suite's slow and vanishing readers, CI variant: interactive streams against the real
server beside clients that never read, read a byte a second or half-close, compared with the same
requests from clients that read; stalled streams cancelled, memory flat, lanes freed."""

from __future__ import annotations

import json

import pytest

from tools.chaos import runner
from tools.chaos.common import PASS
from tools.chaos.scenarios import slow_readers

pytestmark = pytest.mark.slow


def test_slow_readers_fast_passes(model_path, tmp_path):
    o = runner.run_scenario(slow_readers, True, 1, tmp_path, model_path)
    f, p = o.figures, slow_readers.FAST
    assert o.verdict == PASS, f"{o.reason}\n{json.dumps(f, default=str)[:3000]}"
    assert f["stalled_cancelled"] == p["stall"] and f["lanes_busy_after"] == 0 and f["5xx"] == 0
    assert f["rss_fault_peak_mib"] - f["rss_baseline_mib"] <= 64 and f["worker_rss_mib"] is not None
    assert f["streams_baseline"] > 0 and f["streams_fault"] > 0 and f["rate_ratio"] >= p["min_rate_ratio"]
    assert f["vanished_connections"] == p["vanish"] + p["stall"]
