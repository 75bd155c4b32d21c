"""Child processes that die with the process that started them, even when it is SIGKILLed.

An engine worker holds a model (gigabytes); a server that a test or a benchmark starts holds a
model and a worker. SIGKILL runs no cleanup, so whoever starts such a child must make sure the
child notices on its own. Two ways, one for each way a child is started:

* ``popen`` (``subprocess.Popen`` plus a ``preexec_fn``) asks the Linux kernel,
  ``prctl(PR_SET_PDEATHSIG, SIGKILL)``, to kill the child when its parent dies. The kernel ties
  this to the *thread* that started the child, not the process, and tests start servers from
  short-lived pool threads; so every such child is started from one thread of this module's that
  lives as long as the process. Elsewhere than Linux it is a plain ``Popen``.
* ``watch_parent`` runs inside a ``multiprocessing`` child started with ``spawn``: a daemon thread
  waits on the parent's sentinel, a pipe that reads end-of-file once the parent is gone, whatever
  killed it, and then ends the child at once. Not tied to a thread, and not to Linux.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import ctypes.util
import multiprocessing
import multiprocessing.connection
import os
import signal
import subprocess
import sys
import threading

PR_SET_PDEATHSIG = 1

# Looked up before any fork: a preexec_fn runs between fork and exec, where importing or loading
# a library could deadlock on a lock another thread held at the fork.
_prctl = None
if sys.platform.startswith("linux"):
    try:
        _prctl = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True).prctl
    except (OSError, AttributeError):
        _prctl = None


def _die_with(parent_pid: int):
    def preexec() -> None:
        if _prctl is not None:
            _prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent_pid:  # the parent died before the request took effect
            os._exit(1)
    return preexec


_spawner: concurrent.futures.ThreadPoolExecutor | None = None
_spawner_lock = threading.Lock()


def popen(args, **kwargs) -> subprocess.Popen:
    """``subprocess.Popen(args, **kwargs)`` whose child is killed when this process dies."""
    global _spawner
    if _prctl is None:
        return subprocess.Popen(args, **kwargs)
    kwargs["preexec_fn"] = _die_with(os.getpid())
    with _spawner_lock:
        if _spawner is None:
            _spawner = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="lifeline-spawner")
    return _spawner.submit(subprocess.Popen, args, **kwargs).result()


def watch_parent() -> bool:
    """In a spawned ``multiprocessing`` child: exit at once when the parent dies. False (and no
    watch) in a process that has no multiprocessing parent."""
    parent = multiprocessing.parent_process()
    sentinel = getattr(parent, "sentinel", None)
    if sentinel is None:
        return False

    def wait() -> None:
        multiprocessing.connection.wait([sentinel])
        os._exit(70)  # EX_SOFTWARE: nobody is left to read a status, but ps and logs show it

    threading.Thread(target=wait, name="parent-watch", daemon=True).start()
    return True
