"""Every server a test starts dies with the test process, even when that process is SIGKILLed and
runs no cleanup: a child pytest that holds a real server (and its engine worker) is killed, and
neither may be left running."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from superfluid.core import lifeline

from .serverproc import still_running

ROOT = Path(__file__).resolve().parents[2]


def test_a_sigkilled_pytest_leaves_no_server_and_no_worker(tmp_path):
    pids_file = tmp_path / "pids.json"
    log = open(tmp_path / "child-pytest.log", "wb")
    child = lifeline.popen(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "python_files=hold_server_case.py",
         str(ROOT / "tests" / "server" / "hold_server_case.py")],
        cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
        # no third-party pytest plugins (hypothesis, schemathesis, langsmith...): the case needs none,
        # and importing them took the child ~1.7 s before it started its server; and none of this
        # run's PYTEST_ADDOPTS: a --basetemp there is this run's, which the child would wipe
        env=dict({k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}, SUPERFLUID_HOLD_PIDS=str(pids_file),
                 PYTHONUNBUFFERED="1", PYTEST_DISABLE_PLUGIN_AUTOLOAD="1"))
    held: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 180
        while not pids_file.exists():
            assert child.poll() is None, (tmp_path / "child-pytest.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "the child pytest never held a server"
            time.sleep(0.05)
        pids = json.loads(pids_file.read_text())
        held = [psutil.Process(pids["server"]), psutil.Process(pids["worker"])]
        assert all(p.is_running() for p in held)
        assert held[1].ppid() == held[0].pid  # the worker is the server's own child

        os.kill(child.pid, signal.SIGKILL)
        child.wait(10)
        alive = still_running(held)
        assert not alive, f"left running after the test process was SIGKILLed: {[p.pid for p in alive]}"
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(10)
        for p in held:  # only what this test started, by PID, if the assertion above failed
            if p.is_running():
                p.kill()
        log.close()
