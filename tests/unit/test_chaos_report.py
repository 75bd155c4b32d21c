"""The chaos suite's pure parts: the soak's flatness bounds and the table."""

from __future__ import annotations

from tools.chaos import report
from tools.chaos.common import FAIL, PASS, Outcome
from tools.chaos.scenarios import soak

MIB = 1 << 20


def _timeline(grow_per_sample: float = 0.0, fds_step: int = 0, seconds: int = 300, every: int = 10):
    rows = []
    for i, t in enumerate(range(0, seconds, every)):
        rows.append({"t": t, "daemon_rss": 100 * MIB + i * grow_per_sample, "worker_rss": 400 * MIB,
                     "fds": 20 + i * fds_step, "threads": 4, "lanes": 1, "host_bytes": 2 * MIB})
    return rows


def test_a_flat_run_keeps_every_bound():
    figures, broken = soak.flatness(_timeline(), 300, 64 * MIB)
    assert broken == []
    assert figures["daemon_rss_mib"]["warm"] == 100.0 and figures["fds"]["late_max"] == 20


def test_a_leak_breaks_the_rss_bound():
    _, broken = soak.flatness(_timeline(grow_per_sample=4 * MIB), 300, 64 * MIB)
    assert any(b.startswith("daemon_rss") for b in broken), broken


def test_leaked_descriptors_and_an_overfull_host_tier_break_their_bounds():
    rows = _timeline(fds_step=2)
    rows[-1]["host_bytes"] = 80 * MIB
    _, broken = soak.flatness(rows, 300, 64 * MIB)
    assert any(b.startswith("fds") for b in broken) and any("host tier" in b for b in broken), broken


def test_table_shows_fault_condition_and_verdict():
    outs = [Outcome("soak", "superfluid", PASS, "ok", {"requests": 5}),
            Outcome("soak", "superfluid", FAIL, "a | b", {})]
    text = report.table(outs, {"soak": soak})
    lines = text.splitlines()
    assert lines[0] == "| scenario | fault | pass condition | result | key figures |"
    assert lines[2].startswith(f"| soak | {soak.FAULT} | {soak.PASS} | ✓ ok |") and '"requests": 5' in lines[2]
    assert "✗ a / b" in lines[3]  # a pipe in a reason does not break the row
