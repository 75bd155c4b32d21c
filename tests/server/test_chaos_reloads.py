"""The chaos suite's policy reloads and unloads under load, CI variant: keyed clients (the load
tool's) against the real server while its key policy is rewritten and SIGHUPed (once malformed)
and the model is unloaded and loaded; every answer whole (with a finish_reason) or a documented
refusal, none lost: 10 s of traffic (python -m tools.chaos --scenarios reloads_under_load runs
100 clients for 90 s)."""

from __future__ import annotations

import json

import pytest

from tools.chaos import runner
from tools.chaos.common import PASS
from tools.chaos.scenarios import reloads_under_load

pytestmark = pytest.mark.slow


def test_reloads_under_load_fast_passes(model_path, tmp_path):
    o = runner.run_scenario(reloads_under_load, True, 1, tmp_path, model_path)
    f = o.figures
    assert o.verdict == PASS, f"{o.reason}\n{json.dumps(f, default=str)[:3000]}"
    assert f["lost"] == 0 and f["undocumented"] == 0 and f["whole"] > 0
    assert f["whole"] + f["documented"] == f["requests"] and f["after_ok"] and f["daemon_up"]
    assert f["latency_p50_s"] is not None and f["latency_p99_s"] >= f["latency_p50_s"]
    assert f["reloads"] >= 2 and f["reloads_effective"] == f["reloads"]
    assert f["malformed"] == 1 and f["malformed_kept_old"] == 1
    assert f["unload_load_ok"] == f["unloads"] == 1 and f["saw_model_unloaded"] > 0  # the unload met traffic
