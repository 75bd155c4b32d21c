"""The chaos suite's state-dir scenarios, CI variant (python -m tools.chaos --scenarios
disk_full,kill_mid_write runs the full ones): the --state-dir on a tmpfs that fills up while
sessions seal, park and open; and 4 SIGKILLs of the daemon and its worker while sessions write
their state, each followed by a restart on the same state dir."""

from __future__ import annotations

import json

import pytest

from tools.chaos import runner
from tools.chaos.common import PASS
from tools.chaos.scenarios import disk_full, kill_mid_write

pytestmark = pytest.mark.slow


def _run(module, model_path, tmp_path):
    why = module.unavailable()
    if why:
        pytest.skip(f"{module.KEY}: {why}")
    o = runner.run_scenario(module, True, 1, tmp_path, model_path)
    assert o.verdict == PASS, f"{o.reason}\n{json.dumps(o.figures, default=str)[:3000]}"
    return o.figures


def test_disk_full_fast_passes(model_path, tmp_path):
    f = _run(disk_full, model_path, tmp_path)
    assert f["free_when_full"] == 0 and f["plain_statuses"] == {"200": f["plain_statuses"]["200"]}
    assert f["seal_warnings"] + f["dropped_warnings"] >= 1  # a park could not be written, and said so
    assert f["files_not_whole"] == 0 and f["tmp_left"] == 0
    assert f["resealed"].split("/")[0] == f["resealed"].split("/")[1]


def test_kill_mid_write_fast_passes(model_path, tmp_path):
    f = _run(kill_mid_write, model_path, tmp_path)
    assert f["kills"] == kill_mid_write.FAST["kills"] == f["restarts"]
    assert f["lost_acked_turns"] == 0 and f["corrupt_sessions"] == 0 and f["not_whole_after_restart"] == 0
    assert f["next_turns"] >= f["kills"] and f["next_turn_failures"] == 0
