"""Sessions: a conversation the server keeps — its messages, QoS class and KV — across turns and
across restarts.

Each session has an append-only log (``<state-dir>/sessions/<id>.jsonl``, one JSON record a line,
flushed and fsynced per record) so a restart loses no turn, and at most one park artifact
(``<state-dir>/park/<id>.kv`` plus ``<id>.json`` naming the tokens it holds) so the next turn
after a restart restores the conversation's KV instead of prefilling it. Without a state dir
sessions live in memory only. Nothing here knows about HTTP or engines."""

from __future__ import annotations

import errno
import json
import logging
import os
import secrets
import threading
from pathlib import Path

from .errors import ConfigError, SuperfluidError
from .session_log import StorageFull, append_record, cut_torn_line, fsync_dir, replay
from .session_model import Session

__all__ = ["Session", "SessionConflict", "SessionNotFound", "SessionStore", "StorageFull"]

log = logging.getLogger("superfluid.sessions")


class SessionNotFound(SuperfluidError):
    status = 404
    type = "invalid_request_error"
    code = "session_not_found"


class SessionConflict(SuperfluidError):
    status = 409
    type = "invalid_request_error"
    code = "session_conflict"


class SessionStore:
    """All sessions, with their logs and park artifacts under ``state_dir`` (None: memory only)."""

    def __init__(self, state_dir: str | None):
        self.dir = Path(state_dir) if state_dir else None
        self.sessions: dict[str, Session] = {}
        self._lock = threading.Lock()
        if self.dir is not None:
            for sub in ("sessions", "park"):
                path = self.dir / sub
                try:
                    path.mkdir(parents=True, exist_ok=True)
                    probe = path / ".write-test"
                    probe.write_bytes(b"")
                    probe.unlink()
                except OSError as exc:
                    raise ConfigError(f"--state-dir {state_dir}: not writable ({exc.strerror or exc})") from None

    # ---- paths -------------------------------------------------------------------------------

    def _log_path(self, sid: str) -> Path:
        return self.dir / "sessions" / f"{sid}.jsonl"

    def artifact_path(self, sid: str) -> str | None:
        return str(self.dir / "park" / f"{sid}.kv") if self.dir is not None else None

    def _artifact_meta(self, sid: str) -> Path:
        return self.dir / "park" / f"{sid}.json"

    # ---- the log -----------------------------------------------------------------------------

    def _append(self, session: Session, record: dict, required: bool = True) -> bool:
        """Append a record to the session's log (:func:`.session_log.append_record`); memory only: a no-op."""
        if self.dir is None:
            return True
        return append_record(self._log_path(session.id), session.id, record, self._lock, required)


    def create(self, model: str, qos: str, system: str | None, pin_system: bool = False,
               owner: str | None = None, origin: str | None = None) -> Session:
        """A new session; ``owner``: who opened it (a front end's name for the client, e.g. its
        API key's), kept in the log so ownership survives a restart; ``origin``: the front end
        that opened it on its own (the Responses API: its retention may :meth:`remove` it)."""
        session = Session(id="sess_" + secrets.token_hex(12), model=model, qos=qos, system=system,
                          pin_system=pin_system, owner=owner, origin=origin)
        record = {"op": "create", "id": session.id, "model": model, "qos": qos, "system": system,
                  "pin_system": pin_system, "created": session.created, "owner": owner}
        if origin is not None:
            record["origin"] = origin
        self._append(session, record)
        self.sessions[session.id] = session  # only once its log exists: a restart knows it too
        log.info("session %s created on %s (%s)", session.id, model, qos)
        return session

    def get(self, sid: str) -> Session:
        session = self.sessions.get(sid)
        if session is None:
            raise SessionNotFound(f"No session with id {sid!r}", param="session_id")
        return session

    def record_turn(self, session: Session, new: list[dict], reply: dict, prompt_tokens: list[int],
                    extra: dict | None = None) -> None:
        """Append a finished turn; ``extra``: what its front end keeps with it (:attr:`Session.extras`).
        The record is on disk before the session changes: a turn that cannot be logged raises
        :class:`StorageFull` and is not recorded at all."""
        record = {"op": "turn", "n": session.turns + 1, "messages": new, "reply": reply}
        if extra is not None:
            record["extra"] = extra
        self._append(session, record)
        session.messages.extend(new)
        session.messages.append(reply)
        session.turns += 1
        session.prompt_tokens = list(prompt_tokens)
        if extra is not None:
            session.extras[session.turns] = extra

    def forget_extra(self, session: Session, n: int) -> None:
        """Drop what a front end kept with turn ``n`` (a deleted response); the turn itself stays."""
        if n in session.extras:
            self._append(session, {"op": "forget", "n": n})
            session.extras.pop(n, None)

    def drop_before(self, session: Session, index: int) -> None:
        """Leave messages before ``index`` (bar the anchor) out of later prompts; the log and
        ``messages`` keep them."""
        self._append(session, {"op": "window", "start": index})
        session.window_start = index

    def set_qos(self, session: Session, qos: str) -> None:
        self._append(session, {"op": "qos", "qos": qos})
        session.qos = qos

    def parked(self, session: Session, tokens: list[int] | None) -> None:
        """The session's KV was written to its park artifact (``tokens``: what it holds; None: it
        was not, and an artifact sealed earlier stays). An artifact whose metadata cannot be
        written is dropped; the park record is informational (a full disk skips it)."""
        session.state = "parked"
        if tokens and self.dir is not None:
            if self._write_meta(session, tokens):
                session.artifact_adopted_by = None
        self._append(session, {"op": "park", "tokens": len(session.artifact_tokens or [])}, required=False)

    def sealed(self, session: Session, tokens: list[int], loop: object) -> None:
        """A finished turn's KV was written to the park artifact (--park): the session stays open,
        and ``loop``, whose cache still holds that KV, does not load the artifact back."""
        if not tokens or self.dir is None:
            return
        self._write_meta(session, tokens)
        session.artifact_adopted_by = loop

    def _write_meta(self, session: Session, tokens: list[int]) -> bool:
        """Name the tokens the park artifact holds and its KV file's size (after the KV file is in
        place: written whole, synced and renamed), replaced atomically. The size ties the two: a
        kill between the KV file's rename and this leaves metadata that names another size, and
        the pair is refused at recovery. If this cannot be written (a full disk) the artifact is
        dropped — both files — with a warning, and the session's next turn prefills again.
        Whether the artifact stands."""
        final = self._artifact_meta(session.id)
        tmp = final.with_name(f"{final.name}.{secrets.token_hex(4)}.tmp")
        try:
            kv_bytes = os.stat(self.artifact_path(session.id)).st_size
            if kv_bytes <= 0:
                raise OSError(errno.ENODATA, "empty KV file")
            meta = {"tokens": tokens, "model": session.model, "turns": session.turns, "kv_bytes": kv_bytes}
            with open(tmp, "w", encoding="utf-8") as f:
                f.write(json.dumps(meta))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, final)
            fsync_dir(final.parent)
        except OSError as exc:
            try:
                tmp.unlink()
            except OSError:
                pass
            self._drop_artifact(session)
            log.warning("session %s: park artifact dropped (its metadata could not be written: %s); its next "
                        "turn prefills again", session.id, exc.strerror or exc)
            return False
        session.artifact_tokens = list(tokens)
        return True

    def resumed(self, session: Session) -> None:
        if session.state == "parked":
            session.state = "open"
            self._append(session, {"op": "resume"}, required=False)

    def close(self, session: Session) -> None:
        self._append(session, {"op": "close"})
        session.state = "closed"
        self._drop_artifact(session)

    def close_artifact(self, session: Session) -> None:
        """Delete a closed session's park artifact again: a seal that was writing it when the
        session closed may have put it back."""
        if session.state == "closed":
            self._drop_artifact(session)

    def remove(self, session: Session) -> None:
        """Forget a session entirely: from memory, and its log and park artifact from the state dir
        (a stored response's conversation evicted by its front end's retention). A KV prefix the
        engines still cache stays, as any cached prefix does, until the pool needs the room."""
        self.sessions.pop(session.id, None)
        session.state = "closed"
        self._drop_artifact(session)
        if self.dir is not None:
            try:
                self._log_path(session.id).unlink()
            except FileNotFoundError:
                pass
            except OSError as exc:
                log.warning("session %s: its log could not be removed (%s)", session.id, exc.strerror or exc)
        log.info("session %s removed (%d turns)", session.id, session.turns)

    def _drop_artifact(self, session: Session) -> None:
        session.artifact_tokens = None
        if self.dir is None:
            return
        for path in (Path(self.artifact_path(session.id)), self._artifact_meta(session.id)):
            try:
                path.unlink()
            except FileNotFoundError:
                pass

    # ---- recovery -----------------------------------------------------------------------------

    def recover(self) -> int:
        """Rebuild sessions from their logs and park artifacts; damaged records are skipped with a
        warning, never fatal. Returns how many sessions were recovered."""
        if self.dir is None:
            return 0
        self._remove_leftovers()
        for path in sorted((self.dir / "sessions").glob("*.jsonl")):
            cut_torn_line(path)
            session = replay(path)
            if session is None:
                continue
            if session.state != "closed":
                session.artifact_tokens = self._read_artifact(session)
                if session.artifact_tokens:
                    session.state = "parked"
            self.sessions[session.id] = session
        self._remove_unusable_artifacts()
        if self.sessions:
            log.info("recovered %d sessions from %s", len(self.sessions), self.dir)
        return len(self.sessions)

    def _remove_leftovers(self) -> None:
        """Temporary files of writes a kill (or a full disk) cut short: never read, only in the way."""
        gone = 0
        for sub in ("park", "sessions"):
            for path in (self.dir / sub).glob("*.tmp"):
                try:
                    path.unlink()
                    gone += 1
                except OSError:
                    pass
        if gone:
            log.warning("removed %d temporary files that unfinished writes left in %s", gone, self.dir)

    def _remove_unusable_artifacts(self) -> None:
        """Park artifacts no recovered session uses (closed or unknown sessions, halves of a pair,
        refused ones): deleted, so every artifact on disk is one that loads."""
        usable = {sid for sid, s in self.sessions.items() if s.artifact_tokens and s.state != "closed"}
        for path in list((self.dir / "park").glob("*.kv")) + list((self.dir / "park").glob("*.json")):
            if path.stem not in usable:
                try:
                    path.unlink()
                except OSError:
                    pass

    def _read_artifact(self, session: Session) -> list[int] | None:
        meta_path = self._artifact_meta(session.id)
        kv_path = Path(self.artifact_path(session.id))
        if not meta_path.exists() and not kv_path.exists():
            return None
        try:
            meta = json.loads(meta_path.read_text())
            tokens = meta["tokens"]
            if not (isinstance(tokens, list) and tokens and all(isinstance(t, int) for t in tokens)):
                raise ValueError("no token list")
            size = kv_path.stat().st_size
            if size == 0:
                raise ValueError("empty KV file")
            if meta.get("kv_bytes") is not None and meta["kv_bytes"] != size:
                raise ValueError(f"the KV file holds {size} bytes, its metadata names {meta['kv_bytes']} "
                                 "(a write was cut short)")
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("session %s: park artifact unusable (%s); its next turn prefills again",
                        session.id, exc)
            return None
        return tokens
