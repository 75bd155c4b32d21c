"""The chaos suite's memory pressure, CI variant: the real server in a memory cgroup whose limit
the host tier outgrows (the ladder must act, no kill), then cut below one lane's parked KV (the
OOM killer kills the worker; the lanes resume on a new one). Between the two the daemon keeps its
host tier closed 5 s (SUPERFLUID_TEST_HOST_PAUSE_S) instead of 30 s, and the scenario waits that
out. n/a, skipped, without root or a memory cgroup."""

from __future__ import annotations

import json

import pytest

from tools.chaos import runner
from tools.chaos.common import PASS
from tools.chaos.scenarios import memory_pressure

pytestmark = pytest.mark.slow


def test_memory_pressure_fast_passes(model_path, tmp_path):
    why = memory_pressure.unavailable()
    if why:
        pytest.skip(why)
    o = runner.run_scenario(memory_pressure, True, 1, tmp_path, model_path)
    f = o.figures
    assert o.verdict == PASS, f"{o.reason}\n{json.dumps(f, default=str)[:3000]}"
    assert f["oom_kills_phase1"] == 0 and f["host_os_pressure_evictions"] >= 1  # the ladder, before any kill
    assert f["ws_peak_mb"] < f["limit_mb"] and f["ws_after_ladder_mb"] < f["ws_peak_mb"]
    assert f["oom_kills"] >= 1 and f["worker_restarted"] and f["daemon_up"]  # then a real kill, survived
    assert f["lanes_resumed_whole"] and f["after_ok"]
