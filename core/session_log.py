"""A session's log on disk: records appended whole and synced (a failed write cut back off), a
torn last line cut at recovery, and the log replayed into a :class:`~.session_model.Session`.

Each session has an append-only log (``<state-dir>/sessions/<id>.jsonl``, one JSON record a line).
Records: ``create``, ``turn``, ``forget``, ``qos``, ``window``, ``park``, ``resume``, ``close``."""

from __future__ import annotations

import errno
import json
import logging
import os
import threading
from pathlib import Path

from .errors import SuperfluidError
from .session_model import Session

log = logging.getLogger("superfluid.sessions")


class StorageFull(SuperfluidError):
    """A record the session needs could not be written to the state dir (a full disk: 507; any
    other write error: 500). Nothing of the request was kept."""

    status = 507
    type = "server_error"
    code = "insufficient_storage"


def storage_error(sid: str, exc: OSError) -> StorageFull:
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return StorageFull(f"session {sid}: the state dir is full ({exc.strerror}); nothing was recorded, "
                           "retry once space is freed")
    return StorageFull(f"session {sid}: writing the state dir failed ({exc.strerror or exc}); nothing was "
                       "recorded", status=500, code="state_write_failed")


def fsync_dir(path: Path) -> None:
    """Make a rename in ``path`` durable (a power loss, not only a kill, keeps it)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def append_record(path: Path, sid: str, record: dict, lock: threading.Lock, required: bool = True) -> bool:
    """Append a record to the log at ``path``, synced before this returns. A write that fails
    (a full disk) is cut off again, so the log never holds half a record: ``required``
    records raise :class:`StorageFull` (the caller changes nothing), the others (park,
    resume: a restart does not need them) are skipped with a warning. Whether it was written."""
    data = (json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8")
    with lock:
        fd = None
        size = 0
        try:
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            size = os.fstat(fd).st_size
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        except OSError as exc:
            if fd is not None:
                try:
                    os.ftruncate(fd, size)  # no half record left for the next one to run into
                except OSError:
                    pass
            if size == 0 and record.get("op") == "create":
                try:
                    path.unlink()
                except OSError:
                    pass
            if required:
                log.warning("session %s: its %s record could not be written (%s)", sid,
                            record.get("op"), exc.strerror or exc)
                raise storage_error(sid, exc) from None
            log.warning("session %s: its %s record was not written (%s); nothing a restart needs",
                        sid, record.get("op"), exc.strerror or exc)
            return False
        finally:
            if fd is not None:
                os.close(fd)
    return True


def cut_torn_line(path: Path) -> None:
    """A log whose last line has no newline (a write cut short) is cut back to its last whole
    line, so the next record starts a line of its own instead of running into the torn one."""
    try:
        with open(path, "rb+") as f:
            size = f.seek(0, os.SEEK_END)
            if size == 0:
                return
            f.seek(size - 1)
            if f.read(1) == b"\n":
                return
            back = min(size, 1 << 20)
            f.seek(size - back)
            tail = f.read(back)
            keep = size - back + tail.rfind(b"\n") + 1 if b"\n" in tail else (0 if back == size else size)
            if keep == size:
                return
            f.truncate(keep)
            f.flush()
            os.fsync(f.fileno())
        log.warning("session log %s: a torn last record (%d bytes) cut off", path, size - keep)
    except OSError as exc:
        log.warning("session log %s: could not check its last record (%s)", path, exc)


def replay(path: Path) -> Session | None:
    """A session from its log, or None if the log has no valid create record."""
    session = None
    with open(path, encoding="utf-8", errors="replace") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                op = rec["op"]
                if session is None:
                    if op != "create":
                        raise ValueError("the first record is not a create")
                    session = Session(id=rec["id"], model=rec["model"], qos=rec["qos"],
                                      system=rec.get("system"), pin_system=bool(rec.get("pin_system")),
                                      created=float(rec.get("created", 0)), owner=rec.get("owner"),
                                      origin=rec.get("origin"))
                elif op == "turn":
                    if not isinstance(rec["messages"], list) or not isinstance(rec["reply"], dict):
                        raise ValueError("a turn needs messages and a reply")
                    session.messages.extend(rec["messages"])
                    session.messages.append(rec["reply"])
                    session.turns += 1
                    if isinstance(rec.get("extra"), dict):
                        session.extras[session.turns] = rec["extra"]
                elif op == "forget":
                    session.extras.pop(rec["n"], None)
                elif op == "qos":
                    session.qos = rec["qos"]
                elif op == "window":
                    start = rec["start"]
                    if not isinstance(start, int) or not 0 <= start <= len(session.messages):
                        raise ValueError(f"window start {start!r} outside the conversation")
                    session.window_start = start
                elif op == "close":
                    session.state = "closed"
            except (ValueError, KeyError, TypeError) as exc:
                log.warning("session log %s line %d skipped: %s", path, n, exc)
                if session is None:
                    return None
    return session
