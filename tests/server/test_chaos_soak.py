"""The chaos suite's soak, CI variant: 12 s of mixed traffic from 4 clients on every API against
the real server, its resources sampled every 2 s (python -m tools.chaos --scenarios soak runs the
30-minute one). The checks below are the minute-long variant's: 20 requests, 8 APIs, 5 samples."""

from __future__ import annotations

import json

import pytest

from tools.chaos import runner
from tools.chaos.common import PASS
from tools.chaos.scenarios import soak

pytestmark = pytest.mark.slow


def test_soak_fast_passes(model_path, tmp_path):
    o = runner.run_scenario(soak, True, 1, tmp_path, model_path)
    assert o.verdict == PASS, f"{o.reason}\n{json.dumps(o.figures, default=str)[:3000]}"
    by_kind = o.figures["by_kind"]
    assert sum(by_kind.values()) == o.figures["requests"] >= 20
    assert len([k for k, n in by_kind.items() if n]) >= 8  # most of the APIs were exercised
    assert o.figures["samples"] >= 5 and (tmp_path / "soak.json").exists()
