"""The lane-ownership guard (``core/lane_guard.py``) itself: a lane field written from a daemon
file other than ``core/lane.py`` is a stray, and the daemon's switch (``SUPERFLUID_LANE_GUARD``,
set by the server tests) logs it and records it in the file it names, which is what fails a
server test. A stray is made here by running one assignment compiled under a daemon file's name,
so no daemon file needs a bug for the check to be seen working."""

from __future__ import annotations

import logging

from superfluid.core import lane_guard
from superfluid.core.lane import Lane
from superfluid.core.request import Request
from superfluid.core.textstream import TextStream


def lane(qos: str, first: int) -> Lane:
    req = Request(prompt_tokens=list(range(first, first + 20)), max_tokens=4, sink=lambda e: None, qos=qos)
    return Lane(request=req, text=TextStream(lambda t: b"x"))


def write_from(path, target: Lane, value: int) -> None:
    """``target.n_cached = value``, run as if by code in file ``path``."""
    exec(compile("target.n_cached = value", str(path), "exec"), {"target": target, "value": value})


def test_who_may_write_a_lane():
    core = lane_guard.CORE
    assert not lane_guard.is_stray(core / "lane.py", "n_cached")
    assert not lane_guard.is_stray(core / "prompt_work.py", "pooled")
    assert lane_guard.is_stray(core / "prompt_work.py", "n_cached")
    assert lane_guard.is_stray(core / "scheduler.py", "slot")
    assert lane_guard.is_stray(core.parent / "plugins" / "qos" / "policy.py", "slot")
    assert not lane_guard.is_stray(core.parent / "tests" / "unit" / "test_x.py", "slot")   # tests set lanes up


def test_the_daemon_switch_logs_and_records_a_stray(tmp_path, caplog):
    strays = tmp_path / "strays.txt"
    assert lane_guard.install_from_environment({}) is None          # off unless asked
    uninstall = lane_guard.install_from_environment({lane_guard.ENV: str(strays)})
    try:
        target = lane("interactive", 1)
        with caplog.at_level(logging.ERROR, "superfluid.lane_guard"):
            write_from(lane_guard.CORE / "kv.py", target, 7)
            write_from(lane_guard.CORE / "kv.py", target, 8)            # once per (file, field)
            write_from(lane_guard.CORE / "lane.py", target, 9)          # the owner
    finally:
        uninstall()
    assert target.n_cached == 9                                         # the writes still happen
    lines = strays.read_text().splitlines()
    assert len(lines) == 1 and lines[0].endswith(f"{lane_guard.CORE / 'kv.py'} Lane.n_cached")
    assert [r.getMessage() for r in caplog.records] == [
        f"lane guard: Lane.n_cached written by {lane_guard.CORE / 'kv.py'}, not by the lane's own methods "
        "(core/lane.py)"]


def test_the_unit_guard_catches_a_stray():
    """The unit tests' own guard (the autouse ``lane_fields_owned``) is the same install: a stray
    reported through it."""
    seen = []
    uninstall = lane_guard.install(lambda path, name: seen.append((path, name)))
    try:
        write_from(lane_guard.CORE.parent / "plugins" / "qos" / "x.py", lane("batch", 1), 3)
    finally:
        uninstall()
    assert seen == [(str(lane_guard.CORE.parent / "plugins" / "qos" / "x.py"), "n_cached")]
