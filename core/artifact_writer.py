"""Writing park artifacts off the tick thread.

A seal (``--park`` with ``--state-dir``) writes a session's whole KV to a file and syncs it. On
the tick thread that write stalls every lane decoding beside it: measured on a 2-core AMD EPYC VM
(``tools/bench/sealing.py``), a 2000-token session's 46 MiB took 0.09-0.18 s to write and sync,
against 0.02 s to copy it out of the pool. So the tick only takes the copy (an engine's
``save_writer``, whose closure holds the copied bytes) and this writer's thread writes and syncs
it; the tick after it finishes reports the file in ``TickResult.saved``. Writes run one at a time
in the order asked, so a session's later seal never lands under an earlier one."""

from __future__ import annotations

import os
import queue
import secrets
import threading
from typing import BinaryIO, Callable

Write = Callable[[BinaryIO], object]


def write_atomically(path: str, write: Callable[[BinaryIO], object]) -> int:
    """Write a park artifact whole or not at all: ``write`` fills a temporary file beside ``path``
    (``path.<random>.tmp``), which is synced and renamed to ``path`` (the rename synced too). The
    bytes written; 0 on failure, and then the temporary file is gone (a full disk keeps none of
    it) and whatever was at ``path`` stays."""
    tmp = f"{path}.{secrets.token_hex(4)}.tmp"
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
            size = os.fstat(f.fileno()).st_size
        os.replace(tmp, path)
    except OSError:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        return 0
    try:  # the rename itself survives a power loss, not only a kill
        fd = os.open(os.path.dirname(path) or ".", os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass
    return size


class ArtifactWriter:
    """One thread writing park artifacts, FIFO; the finished ones are collected by the tick."""

    def __init__(self):
        self._queue: queue.Queue[tuple[str, Write] | None] = queue.Queue()
        self._lock = threading.Condition()
        self._finished: dict[str, int] = {}
        self._pending = 0
        self._thread: threading.Thread | None = None

    def submit(self, path: str, write: Write) -> None:
        with self._lock:
            self._pending += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="artifact-writer", daemon=True)
                self._thread.start()
        self._queue.put((path, write))

    def pending(self) -> int:
        with self._lock:
            return self._pending

    def finished(self, wait_s: float = 0.0) -> dict[str, int]:
        """The writes finished since the last call (path -> bytes written, 0: failed). With
        ``wait_s``, wait that long for one if some are pending and none has finished yet (a tick
        with nothing else to do: the loop would otherwise spin on it)."""
        with self._lock:
            if wait_s > 0 and self._pending and not self._finished:
                self._lock.wait(wait_s)
            done, self._finished = self._finished, {}
            return done

    def flush(self, timeout: float | None = None) -> None:
        """Wait for every write asked so far (the worker closing)."""
        with self._lock:
            self._lock.wait_for(lambda: self._pending == 0, timeout)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            path, write = item
            size = write_atomically(path, write)
            with self._lock:
                self._finished[path] = size
                self._pending -= 1
                self._lock.notify_all()
