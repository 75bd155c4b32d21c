"""A pytest plugin that says where the suite's time goes: each test's wall time by phase, and
what the machine did meanwhile, so a slow test is named with its kind.

pytest's ``--durations`` gives times but not why. Here each phase is also charged the machine's
busy CPU share (``/proc/stat``, all processes: the test's servers and workers are other
processes, so the test process's own CPU time would miss them). A test's kind is then:

* **server start**: its set-up (starting a server, building a fixture) took most of its time;
* **waiting**: the machine was mostly idle while it ran (sleeps, timeouts, a killed worker's
  restart, a slow client): time ``pytest-xdist`` or polling can win back;
* **real work**: the machine was busy (prefill and decode, a reference model): time only a
  smaller workload or a shared result wins back.

Load it with ``-p tools.dev.suite_costs`` (``tools/dev/test.sh`` does). ``--costs-file PATH``
writes every test's record as JSON; ``--costs-top N`` (default 15) prints the N slowest with
their kind at the end of the run.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

# Below this share of the machine busy, a phase was waiting rather than computing (one core of
# two busy is 0.5; a client that polls and a server that idles stay near 0.05).
WAITING_BELOW = 0.3


def cpu_ticks() -> tuple[int, int] | None:
    """(busy, total) jiffies of all CPUs since boot, or None where /proc/stat is not there."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    total = sum(fields[:8])  # guest time is already counted in user
    return total - idle, total


def kind(record: dict) -> str:
    """The test's kind (see the module's docstring) from its phases' times and busy shares."""
    setup, call = record["setup_s"], record["call_s"] + record["teardown_s"]
    if setup > call:
        return "server start"
    return "waiting" if record["busy"] is not None and record["busy"] < WAITING_BELOW else "real work"


PROPERTY = "suite_costs_ticks"  # (phase, busy jiffies, all jiffies) in a report's user_properties


def _timed_phase(item, phase: str):
    """Charge a phase the machine's busy jiffies; they travel in the item's user_properties, so
    pytest-xdist's controller reads them from the reports its workers send."""
    ticks = cpu_ticks()
    yield
    after = cpu_ticks()
    if ticks is not None and after is not None:
        item.user_properties.append((PROPERTY, (phase, after[0] - ticks[0], after[1] - ticks[1])))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    yield from _timed_phase(item, "setup")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    yield from _timed_phase(item, "call")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item):
    yield from _timed_phase(item, "teardown")


class SuiteCosts:
    """The controller's side: each test's phases from the reports, summed and ranked."""

    def __init__(self, path: str | None, top: int):
        self.path, self.top = path, top
        self.records: dict[str, dict] = {}

    def pytest_runtest_logreport(self, report):
        r = self.records.setdefault(report.nodeid, {"test": report.nodeid, "setup_s": 0.0, "call_s": 0.0,
                                                    "teardown_s": 0.0, "busy_ticks": 0, "all_ticks": 0})
        r[f"{report.when}_s"] += report.duration
        for name, value in report.user_properties:
            if name == PROPERTY and value[0] == report.when:
                r["busy_ticks"] += value[1]
                r["all_ticks"] += value[2]

    def finished(self) -> list[dict]:
        out = []
        for r in self.records.values():
            r = dict(r, total_s=r["setup_s"] + r["call_s"] + r["teardown_s"])
            r["busy"] = round(r["busy_ticks"] / r["all_ticks"], 3) if r["all_ticks"] else None
            r["kind"] = kind(r)
            out.append(r)
        return sorted(out, key=lambda r: -r["total_s"])

    def pytest_terminal_summary(self, terminalreporter):
        rows = self.finished()
        if self.path:
            Path(self.path).write_text(json.dumps(rows, indent=1))
        if self.top and rows:
            terminalreporter.write_sep("=", f"slowest {min(self.top, len(rows))} tests, with their kind")
            for line in table(rows, self.top):
                terminalreporter.write_line(line)


def table(rows: list[dict], top: int) -> list[str]:
    """The ``top`` slowest of ``rows`` (records as written to ``--costs-file``), a line each."""
    out = []
    for r in sorted(rows, key=lambda r: -r["total_s"])[:top]:
        busy = "  -" if r["busy"] is None else f"{r['busy']:.2f}"
        out.append(f"{r['total_s']:8.1f}s  set-up {r['setup_s']:6.1f}s  busy {busy}  {r['kind']:<12}  {r['test']}")
    return out


def pytest_addoption(parser):
    group = parser.getgroup("suite costs")
    group.addoption("--costs-file", default=os.environ.get("SUPERFLUID_COSTS_FILE"),
                    help="write each test's phases, busy CPU share and kind as JSON here")
    group.addoption("--costs-top", type=int, default=15, help="print the N slowest tests with their kind")


def pytest_configure(config):
    # under pytest-xdist only the controller ranks (its workers' reports reach it with their ticks)
    if getattr(config, "workerinput", None) is None:
        config.pluginmanager.register(SuiteCosts(config.getoption("--costs-file"),
                                                 config.getoption("--costs-top")), "suite-costs")


def main(argv: list[str] | None = None) -> None:
    """``python -m tools.dev.suite_costs [--top N] FILE...``: the slowest tests of several runs'
    ``--costs-file`` records together (``tools/dev/test.sh`` runs the suite in two parts)."""
    import argparse

    parser = argparse.ArgumentParser(description="the slowest tests of one or more --costs-file records")
    parser.add_argument("files", nargs="+")
    parser.add_argument("--top", type=int, default=15)
    args = parser.parse_args(argv)
    rows = [r for f in args.files if Path(f).exists() for r in json.loads(Path(f).read_text())]
    total = sum(r["total_s"] for r in rows)
    print(f"slowest {min(args.top, len(rows))} of {len(rows)} tests ({total:.0f} s of test time), with their kind:")
    print("\n".join(table(rows, args.top)))


if __name__ == "__main__":
    main()
