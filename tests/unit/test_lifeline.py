"""core.lifeline: children die with the process that started them, even when it is SIGKILLed.
Each case starts a real parent process, has it start a sleeping child, SIGKILLs the parent and
waits for the child to go."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from superfluid.core import lifeline

ROOT = Path(__file__).resolve().parents[2]

# A parent that starts its child from a thread that ends at once (as tests start servers from pool
# threads), prints the child's pid and sleeps: the kernel's parent-death signal is tied to the
# starting thread, so only lifeline's own long-lived spawner thread keeps the child alive till then.
POPEN_PARENT = """
import sys, threading, time
from superfluid.core import lifeline
out = {}
t = threading.Thread(target=lambda: out.update(p=lifeline.popen([sys.executable, "-c", "import time; time.sleep(300)"])))
t.start(); t.join()
time.sleep(1.0)
print(out["p"].pid, out["p"].poll(), flush=True)
time.sleep(300)
"""

# A parent with a spawned multiprocessing child that watches it (as the engine workers do).
SPAWN_PARENT = """
import multiprocessing as mp, time
from tests.unit.test_lifeline import sleeping_child
if __name__ == "__main__":
    p = mp.get_context("spawn").Process(target=sleeping_child, daemon=True)
    p.start()
    time.sleep(1.0)
    print(p.pid, p.exitcode, flush=True)
    time.sleep(300)
"""


def sleeping_child() -> None:
    lifeline.watch_parent()
    time.sleep(300)


def run_parent(script: str) -> tuple[subprocess.Popen, psutil.Process]:
    parent = lifeline.popen([sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONPATH=str(ROOT)))
    line = parent.stdout.readline().split()
    assert len(line) == 2 and line[1] == "None", f"the child did not stay up: {line}"
    return parent, psutil.Process(int(line[0]))


def child_outlives_killed_parent(parent: subprocess.Popen, child: psutil.Process) -> bool:
    """SIGKILL the parent; whether the child is still running 10 s later (killed then, by PID)."""
    try:
        assert child.is_running()
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(10)
        _, alive = psutil.wait_procs([child], timeout=10)
        return bool(alive)
    finally:
        if child.is_running():
            child.kill()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_a_popen_child_started_from_a_finished_thread_dies_with_its_sigkilled_parent():
    parent, child = run_parent(POPEN_PARENT)
    assert child.ppid() == parent.pid
    assert not child_outlives_killed_parent(parent, child)


def test_a_spawned_worker_that_watches_its_parent_dies_with_it():
    assert not child_outlives_killed_parent(*run_parent(SPAWN_PARENT))


def test_watch_parent_is_a_no_op_without_a_multiprocessing_parent():
    assert lifeline.watch_parent() is False
