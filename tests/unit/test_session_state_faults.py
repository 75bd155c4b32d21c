"""The state dir under faults (the chaos suite's disk_full and kill_mid_write found these): a write
that fails on a full disk changes nothing and leaves nothing half-written; a kill between two
writes leaves nothing that loads wrong; every restart cleans up what a killed write left."""

from __future__ import annotations

import errno
import json
import os
import threading
import time

import pytest

from superfluid.core import sessions as sessions_mod
from superfluid.core.sessions import SessionStore
from superfluid.core.tick_runner import write_atomically


def _full(*_a, **_k):
    raise OSError(errno.ENOSPC, "No space left on device")


def _lines(path):
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _turn(store, s, text="hi"):
    store.record_turn(s, [{"role": "user", "content": text}], {"role": "assistant", "content": "ok"}, [1, 2, 3])


def _seal(store, s, tokens, kv=b"K" * 100):
    with open(store.artifact_path(s.id), "wb") as f:
        f.write(kv)
    store.sealed(s, tokens, loop=None)


def test_a_turn_that_cannot_be_logged_is_a_507_and_not_recorded(tmp_path, monkeypatch):
    store = SessionStore(str(tmp_path))
    s = store.create("m", "agent", "sys")
    _turn(store, s, "first")
    monkeypatch.setattr(sessions_mod.os, "fsync", _full)
    with pytest.raises(sessions_mod.StorageFull) as err:
        _turn(store, s, "second")
    assert err.value.status == 507 and err.value.code == "insufficient_storage"
    assert s.turns == 1 and len(s.messages) == 2  # the session is as the log says
    monkeypatch.undo()
    log = tmp_path / "sessions" / f"{s.id}.jsonl"
    assert [r["op"] for r in _lines(log)] == ["create", "turn"]  # the failed record was cut off again
    _turn(store, s, "third")
    again = SessionStore(str(tmp_path))
    again.recover()
    assert [m["content"] for m in again.get(s.id).messages if m["role"] == "user"] == ["first", "third"]


def test_a_create_that_cannot_be_logged_keeps_no_session(tmp_path, monkeypatch):
    store = SessionStore(str(tmp_path))
    monkeypatch.setattr(sessions_mod.os, "fsync", _full)
    with pytest.raises(sessions_mod.StorageFull):
        store.create("m", "agent", None)
    assert store.sessions == {}
    assert list((tmp_path / "sessions").iterdir()) == []


def test_park_and_resume_records_are_optional_on_a_full_disk(tmp_path, monkeypatch):
    store = SessionStore(str(tmp_path))
    s = store.create("m", "agent", None)
    monkeypatch.setattr(sessions_mod.os, "fsync", _full)
    store.parked(s, None)  # nothing to write but the record: a warning, not a failure
    assert s.state == "parked"
    store.resumed(s)
    assert s.state == "open"


def test_a_torn_last_line_is_cut_at_recovery_so_the_next_record_survives(tmp_path):
    store = SessionStore(str(tmp_path))
    s = store.create("m", "agent", None)
    _turn(store, s, "first")
    log = tmp_path / "sessions" / f"{s.id}.jsonl"
    with open(log, "a") as f:
        f.write('{"op": "turn", "n": 2, "messa')  # a write cut short
    again = SessionStore(str(tmp_path))
    again.recover()
    s2 = again.get(s.id)
    _turn(again, s2, "second")
    third = SessionStore(str(tmp_path))
    third.recover()
    assert [m["content"] for m in third.get(s.id).messages if m["role"] == "user"] == ["first", "second"]


def test_metadata_that_cannot_be_written_drops_the_artifact(tmp_path, monkeypatch):
    store = SessionStore(str(tmp_path))
    s = store.create("m", "agent", None)
    _turn(store, s)
    _seal(store, s, [1, 2, 3])
    assert s.artifact_tokens == [1, 2, 3]
    with open(store.artifact_path(s.id), "wb") as f:  # the next turn's KV file is in place ...
        f.write(b"L" * 200)
    monkeypatch.setattr(sessions_mod.os, "fsync", _full)
    store.sealed(s, [1, 2, 3, 4, 5], loop=None)  # ... but its metadata cannot be written: no raise
    monkeypatch.undo()
    park = tmp_path / "park"
    assert s.artifact_tokens is None
    assert sorted(p.name for p in park.iterdir()) == []  # neither half is left: next turn prefills


def test_a_kv_file_replaced_after_its_metadata_is_refused_and_removed(tmp_path):
    """A kill between the KV file's rename and its metadata's: the old metadata names other tokens."""
    store = SessionStore(str(tmp_path))
    s = store.create("m", "agent", None)
    _turn(store, s)
    _seal(store, s, [1, 2, 3], kv=b"K" * 100)
    assert json.loads((tmp_path / "park" / f"{s.id}.json").read_text())["kv_bytes"] == 100
    with open(store.artifact_path(s.id), "wb") as f:
        f.write(b"L" * 180)
    again = SessionStore(str(tmp_path))
    again.recover()
    assert again.get(s.id).artifact_tokens is None and again.get(s.id).state == "open"
    assert list((tmp_path / "park").iterdir()) == []


def test_a_whole_artifact_survives_recovery(tmp_path):
    store = SessionStore(str(tmp_path))
    s = store.create("m", "agent", None)
    _turn(store, s)
    _seal(store, s, [1, 2, 3])
    again = SessionStore(str(tmp_path))
    again.recover()
    assert again.get(s.id).artifact_tokens == [1, 2, 3] and again.get(s.id).state == "parked"


def test_recovery_removes_what_killed_writes_left(tmp_path):
    store = SessionStore(str(tmp_path))
    s = store.create("m", "agent", None)
    park = tmp_path / "park"
    (park / f"{s.id}.kv.tmp").write_bytes(b"half")
    (park / f"{s.id}.json.1234.tmp").write_text("{")
    (park / "sess_gone.kv").write_bytes(b"orphan")  # no session, no metadata
    again = SessionStore(str(tmp_path))
    again.recover()
    assert list(park.iterdir()) == []


def test_write_atomically_leaves_no_temporary_file_when_the_disk_is_full(tmp_path):
    path = str(tmp_path / "a.kv")
    assert write_atomically(path, lambda f: f.write(b"old")) == 3

    def half(f):
        f.write(b"new new new")
        f.flush()
        raise OSError(errno.ENOSPC, "No space left on device")

    assert write_atomically(path, half) == 0
    assert sorted(os.listdir(tmp_path)) == ["a.kv"] and open(path, "rb").read() == b"old"


def _parking_daemon(loop, tmp_path, monkeypatch):
    """A Daemon with one model "m" whose loop is ``loop`` (its ``save_prefix`` stands in for the
    engine's tick), --park on and a state dir, and one open session with a prompt; (daemon,
    session)."""
    from superfluid.core import daemon as daemon_mod
    from superfluid.core.daemon import Daemon

    class Runtime:
        config = None
    Runtime.loop = loop

    class Opts:
        park = True
    monkeypatch.setattr(daemon_mod, "CORE_OPTIONS", type("O", (), {"of": staticmethod(lambda _c: Opts)}))
    daemon = Daemon.__new__(Daemon)
    daemon.sessions = SessionStore(str(tmp_path))
    daemon.models = {"m": Runtime()}
    daemon._seal_locks = {}
    session = daemon.sessions.create("m", "agent", None)
    session.prompt_tokens = [1, 2, 3]
    return daemon, session


def test_a_park_waits_for_the_seal_of_the_same_session(tmp_path, monkeypatch):
    """One KV write per session at a time: a park right after a turn does not race its seal."""
    active, overlaps = [0], []

    class Loop:
        def save_prefix(self, tokens, path, timeout=60.0):
            active[0] += 1
            overlaps.append(active[0])
            time.sleep(0.2)
            with open(path, "wb") as f:
                f.write(b"K" * 10)
            active[0] -= 1
            return list(tokens)

    daemon, s = _parking_daemon(Loop(), tmp_path, monkeypatch)
    t = threading.Thread(target=daemon.seal_session, args=(s,))
    t.start()
    time.sleep(0.05)
    daemon.park_session(s)
    t.join()
    assert max(overlaps) == 1


def test_a_closed_session_keeps_no_artifact_that_its_last_seal_was_writing(tmp_path, monkeypatch):
    """DELETE right after a turn: the turn's seal (in the background) may have its KV file on disk
    before the tick that reports it. The close waits for that seal and deletes what it wrote, so
    nothing of the session is on disk when the close returns, nor later; a seal asked after the
    close writes nothing. (A fresh clone's test_sessions met the file after its DELETE.)"""
    answered = threading.Event()

    class Loop:
        def save_prefix(self, tokens, path, timeout=60.0):
            time.sleep(0.1)
            with open(path, "wb") as f:  # the writer thread lands the file ...
                f.write(b"K" * 10)
            time.sleep(0.2)              # ... and the next tick reports it
            answered.set()
            return list(tokens)

    daemon, s = _parking_daemon(Loop(), tmp_path, monkeypatch)
    kv = daemon.sessions.artifact_path(s.id)
    sealing = threading.Thread(target=daemon.seal_session, args=(s,))
    sealing.start()
    time.sleep(0.05)
    daemon.sessions.close(s)
    daemon.settle_closed_session(s)
    assert answered.is_set()        # it waited for the seal ...
    assert not os.path.exists(kv)   # ... and removed what the seal wrote
    sealing.join()
    assert daemon.seal_session(s) == 0 and not os.path.exists(kv)
    assert not os.path.exists(daemon.sessions._artifact_meta(s.id))
