"""The memory cgroup's limit as a pressure source: a daemon in a container (or any memory cgroup)
is OOM-killed at the cgroup's limit, long before the host runs short, so the pressure ladder must
read the cgroup's own usage against its own limit. Fake cgroup trees (v1 and v2) in tmp_path."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from superfluid.plugins.pressure import cgroup as cg
from superfluid.plugins.pressure import sources as psrc

MIB = 1 << 20
V1_PROC = "12:pids:/\n4:memory:/box/inner\n1:name=systemd:/\n0::/\n"
V2_PROC = "0::/box/inner\n"


def v1_tree(root, limit, usage, inactive_file=0, parent_limit=None):
    d = root / "memory" / "box" / "inner"
    d.mkdir(parents=True)
    (d / "memory.limit_in_bytes").write_text(f"{limit}\n")
    (d / "memory.usage_in_bytes").write_text(f"{usage}\n")
    (d / "memory.stat").write_text(f"cache 1\nrss {usage}\ntotal_inactive_file {inactive_file}\n")
    parent = root / "memory" / "box"
    (parent / "memory.limit_in_bytes").write_text(f"{parent_limit or cg.V1_UNLIMITED}\n")
    (parent / "memory.usage_in_bytes").write_text(f"{usage}\n")
    (parent / "memory.stat").write_text(f"total_inactive_file {inactive_file}\n")
    return d


def v2_tree(root, limit, usage, inactive_file=0, psi=None):
    root.mkdir(parents=True, exist_ok=True)
    (root / "cgroup.controllers").write_text("cpu io memory pids\n")
    d = root / "box" / "inner"
    d.mkdir(parents=True)
    (d / "memory.max").write_text(f"{limit}\n")
    (d / "memory.current").write_text(f"{usage}\n")
    (d / "memory.stat").write_text(f"anon {usage}\ninactive_file {inactive_file}\n")
    if psi is not None:
        (d / "memory.pressure").write_text(psi)
    (root / "box" / "memory.max").write_text("max\n")
    (root / "box" / "memory.current").write_text(f"{usage}\n")
    return d


def test_finds_the_v1_memory_controller_path(tmp_path):
    d = v1_tree(tmp_path, 1000 * MIB, 100 * MIB)
    assert cg.memory_cgroup_dirs(V1_PROC, tmp_path)[0] == d


def test_finds_the_v2_path(tmp_path):
    d = v2_tree(tmp_path, 1000 * MIB, 100 * MIB)
    assert cg.memory_cgroup_dirs(V2_PROC, tmp_path)[0] == d


def test_a_container_sees_its_cgroup_at_the_root(tmp_path):
    """Inside a container /proc/self/cgroup names the host's path, but the container's own
    cgroup is mounted at the root."""
    (tmp_path / "memory").mkdir()
    (tmp_path / "memory" / "memory.limit_in_bytes").write_text(f"{512 * MIB}\n")
    assert cg.memory_cgroup_dirs(V1_PROC, tmp_path) == [tmp_path / "memory"]


@pytest.mark.parametrize("usage,inactive,level", [
    (500, 0, "ok"),
    (905, 0, "warning"),        # under 10 % of the limit left
    (960, 0, "critical"),       # under 5 %
    (960, 200, "ok"),           # inactive file pages are reclaimed before an OOM kill: not counted
])
def test_v1_levels_from_the_limit(tmp_path, usage, inactive, level):
    v1_tree(tmp_path, 1000 * MIB, usage * MIB, inactive * MIB)
    assert cg.CgroupMemory(V1_PROC, tmp_path).level() == level


def test_v1_an_ancestors_limit_counts(tmp_path):
    v1_tree(tmp_path, cg.V1_UNLIMITED, 960 * MIB, parent_limit=1000 * MIB)
    assert cg.CgroupMemory(V1_PROC, tmp_path).level() == "critical"


def test_v2_levels_and_the_cgroups_own_psi(tmp_path):
    d = v2_tree(tmp_path, 1000 * MIB, 500 * MIB)
    src = cg.CgroupMemory(V2_PROC, tmp_path)
    assert src.level() == "ok"
    (d / "memory.current").write_text(f"{920 * MIB}\n")    # read again at every call
    assert src.level() == "warning"
    (d / "memory.current").write_text(f"{100 * MIB}\n")
    (d / "memory.pressure").write_text("some avg10=0.00 avg60=0.00 avg300=0.00 total=1\n"
                                       "full avg10=25.00 avg60=3.00 avg300=1.00 total=99\n")
    assert src.level() == "critical"


def test_no_limit_no_cgroup_or_unreadable_is_ok(tmp_path):
    v2_tree(tmp_path, "max", 900 * MIB)
    assert cg.CgroupMemory(V2_PROC, tmp_path).level() == "ok"
    assert cg.CgroupMemory(V2_PROC, tmp_path / "nowhere").level() == "ok"
    assert cg.CgroupMemory("", tmp_path).level() == "ok"


def test_the_pressure_plugin_registers_the_cgroup_beside_the_host():
    """The defect: only the host's PSI and free memory were read, so a worker near its container's
    limit was OOM-killed while the ladder still read "ok". The gauge takes the worst source."""
    from superfluid.core.cli import load
    from superfluid.plugins import pressure

    registered = []
    pressure.superfluid_add_pressure_sources(register=registered.append, config=load(["serve"])[0])
    assert {type(s).__name__ for s in registered} == {"OsPressure", "CgroupMemory"}
    assert {s.name for s in registered} == {"os", "cgroup"}


def test_the_real_cgroup_of_this_process_reads(tmp_path):
    assert cg.CgroupMemory().level() in psrc.LEVELS
