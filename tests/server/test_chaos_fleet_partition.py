"""The chaos suite's fleet partition, CI variant: three nodes in network namespaces behind
``superfluid fleet``, one cut off (its packets dropped) while streams run on it, healed, then
put behind 500 ms of delay and 5 % loss (a userspace relay: no sch_netem), healed again. Each phase
ends once it has shown what it is there to show (the cut detected and its requests ended elsewhere,
the node back and answering, requests through the impaired path ended), its FAST length the most
it lasts (python -m tools.chaos --scenarios fleet_partition holds the full lengths). Needs root and
``ip netns``: skipped otherwise, with the reason."""

from __future__ import annotations

import json

import pytest

from tools.chaos import runner
from tools.chaos.common import PASS
from tools.chaos.scenarios import fleet_partition

pytestmark = pytest.mark.slow


def test_fleet_partition_fast_passes(model_path, tmp_path):
    why = fleet_partition.unavailable()
    if why:
        pytest.skip(why)
    o = runner.run_scenario(fleet_partition, True, 1, tmp_path, model_path)
    f = o.figures
    assert o.verdict == PASS, f"{o.reason}\n{json.dumps(f, default=str)[:4000]}"
    # the cut was seen, and soon; the node came back after each heal
    assert f["detect_s"] is not None and f["detect_s"] <= fleet_partition.FAST["detect_bound_s"]
    assert f["rejoin_s"] is not None and f["rejoin2_s"] is not None
    assert f["served_after_heal"] >= 1 and f["served_after_heal2"] >= 1
    # streams were running on the cut node, and each ended with an error event, not a hang
    started = f["started_on_cut_node"]
    assert started["n"] >= 1 and set(started["outcomes"]) <= {"error_event", "ok"}
    assert max(started["ended_after_cut_s"]) <= fleet_partition.FAST["stream_bound_s"]
    # what was sent during the cut completed elsewhere; nothing hung or ended unclearly
    during = f["sent_during_cut"]
    assert during["n"] >= 5 and during["outcomes"] == {"ok": during["n"]} and f["cut_node"] not in during["nodes"]
    assert f["hangs"] == 0 and f["unclear"] == 0
    # it was a partition (packets dropped, link up), and nothing of it is left
    assert f["packets_dropped"] > 0 and f["link_up_during_cut"] is True and f["left_behind"] == []
    timeline = json.loads((tmp_path / "fleet_partition.json").read_text())
    assert [e["event"] for e in timeline["events"]][:4] == ["baseline", "cut", "heal", "delay+loss"]
    assert timeline["states"] and timeline["requests"]
