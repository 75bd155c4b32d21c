"""tools/chaos/netns.py: what a fleet scenario made in the kernel (namespaces, veth pairs) does not
outlive it. A run that ends normally deletes its own; one that was SIGKILLed cannot, so the next
run deletes the namespaces and links of runs whose process is gone. Needs root and ``ip netns``:
skipped otherwise, with the reason."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tools.chaos import netns

pytestmark = pytest.mark.skipif(netns.unavailable() is not None, reason=str(netns.unavailable()))


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def _names() -> str:
    return netns.sh("ip", "netns", "list").stdout + netns.sh("ip", "-br", "link").stdout


def test_a_killed_runs_namespaces_and_links_are_deleted_by_the_next_run():
    tag = f"sfc{_dead_pid()}"
    netns.sh("ip", "netns", "add", f"{tag}n0")
    netns.sh("ip", "link", "add", f"{tag}h0", "type", "veth", "peer", "name", f"{tag}v0")
    netns.sh("ip", "link", "set", f"{tag}v0", "netns", f"{tag}n0")
    try:
        assert tag in _names()
        net = netns.Net()  # the next run
        assert tag not in _names(), "a dead run's namespace or link was left"
        net.add(0)
        assert net.tag in _names()
        net.delete()
        assert net.leftovers() == []
    finally:
        netns.sh("ip", "link", "del", f"{tag}h0", check=False)
        netns.sh("ip", "netns", "del", f"{tag}n0", check=False)


def test_a_live_runs_namespaces_are_kept():
    first = netns.Net()
    first.add(0)
    try:
        netns.Net()  # another run in the same process: this one's are live
        assert first.ns(0) in _names()
    finally:
        first.delete()
