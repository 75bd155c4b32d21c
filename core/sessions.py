"""Sessions: a conversation the server keeps — its messages, QoS class and KV — across turns and
across restarts.

Each session has an append-only log (``<state-dir>/sessions/<id>.jsonl``, one JSON record a line,
flushed and fsynced per record) so a restart loses no turn, and at most one park artifact
(``<state-dir>/park/<id>.kv`` plus ``<id>.json`` naming the tokens it holds) so the next turn
after a restart restores the conversation's KV instead of prefilling it. Without a state dir
sessions live in memory only. Nothing here knows about HTTP or engines."""

from __future__ import annotations

import json
import logging
import os
import secrets
import threading
import time
from pathlib import Path

import attrs

from .errors import ConfigError, SuperfluidError

log = logging.getLogger("superfluid.sessions")


class SessionNotFound(SuperfluidError):
    status = 404
    type = "invalid_request_error"
    code = "session_not_found"


class SessionConflict(SuperfluidError):
    status = 409
    type = "invalid_request_error"
    code = "session_conflict"


@attrs.define(eq=False)
class Session:
    id: str
    model: str
    qos: str
    system: str | None = None
    pin_system: bool = False  # the system prompt's cached KV is evicted last while the session is open
    created: float = attrs.field(factory=time.time)
    messages: list[dict] = attrs.field(factory=list)   # every turn's messages and replies, in order
    turns: int = 0
    state: str = "open"                                 # open | parked | closed
    prompt_tokens: list[int] = attrs.field(factory=list)  # the last turn's prompt (its KV is cached)
    artifact_tokens: list[int] | None = None           # what the park artifact on disk holds
    # The model loop that took the park artifact into its host tier, and the one holding the
    # system prompt's pin: a model unloaded and loaded again has a new loop holding neither.
    artifact_adopted_by: object | None = attrs.field(default=None, repr=False)
    busy: bool = False                                  # a turn is running
    pinned_tokens: list[int] | None = None              # the system prompt's tokens, once pinned
    pinned_by: object | None = attrs.field(default=None, repr=False)
    window_start: int = 0  # messages before this index (bar the anchor) no longer reach the prompt
    owner: str | None = None  # the name of the API key that opened it (an opaque string; None: no policy)
    # turn number (1-based) → what the front end that ran the turn keeps with it (the Responses
    # API's stored response object), logged with the turn so it survives a restart
    extras: dict[int, dict] = attrs.field(factory=dict)

    @property
    def anchor(self) -> int:
        """Leading messages a prompt always keeps: the first user message (the task), if the
        conversation starts with one; chat templates may insist on a user query."""
        return 1 if self.messages and self.messages[0].get("role") == "user" else 0

    def history(self, window_start: int | None = None) -> list[dict]:
        """The messages a new turn's prompt starts with: the system prompt, the anchor, and the
        messages from ``window_start`` (default: the session's) on."""
        start = self.window_start if window_start is None else window_start
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + self.messages[:self.anchor] + self.messages[max(start, self.anchor):]

    def window_cuts(self) -> list[int]:
        """Where the kept history may start, oldest first: after the anchor and the current
        window, at an assistant or user message (a tool result stays with the call it answers)."""
        first = max(self.window_start, self.anchor) + 1
        return [i for i in range(first, len(self.messages))
                if self.messages[i].get("role") in ("assistant", "user")]

    @property
    def dropped_messages(self) -> int:
        return max(self.window_start - self.anchor, 0)

    def view(self) -> dict:
        return {"id": self.id, "object": "session", "model": self.model, "qos": self.qos,
                "system": self.system, "pin_system": self.pin_system, "state": self.state, "turns": self.turns,
                "created": int(self.created), "busy": self.busy,
                "parked_tokens": len(self.artifact_tokens or []),
                "window_start": self.window_start, "dropped_messages": self.dropped_messages,
                "owner": self.owner}


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

    def _append(self, session: Session, record: dict) -> None:
        if self.dir is None:
            return
        line = json.dumps(record, ensure_ascii=False) + "\n"
        with self._lock, open(self._log_path(session.id), "a", encoding="utf-8") as f:
            f.write(line)
            f.flush()
            os.fsync(f.fileno())

    # ---- operations ----------------------------------------------------------------------------

    def create(self, model: str, qos: str, system: str | None, pin_system: bool = False,
               owner: str | None = None) -> Session:
        """A new session; ``owner``: who opened it (a front end's name for the client, e.g. its
        API key's), kept in the log so ownership survives a restart."""
        session = Session(id="sess_" + secrets.token_hex(12), model=model, qos=qos, system=system,
                          pin_system=pin_system, owner=owner)
        self.sessions[session.id] = session
        self._append(session, {"op": "create", "id": session.id, "model": model, "qos": qos,
                               "system": system, "pin_system": pin_system, "created": session.created,
                               "owner": owner})
        log.info("session %s created on %s (%s)", session.id, model, qos)
        return session

    def get(self, sid: str) -> Session:
        session = self.sessions.get(sid)
        if session is None:
            raise SessionNotFound(f"No session with id {sid!r}", param="session_id")
        return session

    def record_turn(self, session: Session, new: list[dict], reply: dict, prompt_tokens: list[int],
                    extra: dict | None = None) -> None:
        """Append a finished turn; ``extra``: what its front end keeps with it (:attr:`Session.extras`)."""
        session.messages.extend(new)
        session.messages.append(reply)
        session.turns += 1
        session.prompt_tokens = list(prompt_tokens)
        record = {"op": "turn", "n": session.turns, "messages": new, "reply": reply}
        if extra is not None:
            session.extras[session.turns] = record["extra"] = extra
        self._append(session, record)

    def forget_extra(self, session: Session, n: int) -> None:
        """Drop what a front end kept with turn ``n`` (a deleted response); the turn itself stays."""
        if session.extras.pop(n, None) is not None:
            self._append(session, {"op": "forget", "n": n})

    def drop_before(self, session: Session, index: int) -> None:
        """Leave messages before ``index`` (bar the anchor) out of later prompts; the log and
        ``messages`` keep them."""
        session.window_start = index
        self._append(session, {"op": "window", "start": index})

    def set_qos(self, session: Session, qos: str) -> None:
        session.qos = qos
        self._append(session, {"op": "qos", "qos": qos})

    def parked(self, session: Session, tokens: list[int] | None) -> None:
        """The session's KV was written to its park artifact (``tokens``: what it holds)."""
        session.state = "parked"
        if tokens and self.dir is not None:
            self._write_meta(session, tokens)
            session.artifact_adopted_by = None
        self._append(session, {"op": "park", "tokens": len(tokens or [])})

    def sealed(self, session: Session, tokens: list[int], loop: object) -> None:
        """A finished turn's KV was written to the park artifact (--park): the session stays open,
        and ``loop``, whose cache still holds that KV, does not load the artifact back."""
        if not tokens or self.dir is None:
            return
        self._write_meta(session, tokens)
        session.artifact_adopted_by = loop

    def _write_meta(self, session: Session, tokens: list[int]) -> None:
        """Name the tokens the park artifact holds (after the KV file is in place: written whole,
        synced and renamed), replaced atomically."""
        meta = {"tokens": tokens, "model": session.model, "turns": session.turns}
        tmp = self._artifact_meta(session.id).with_suffix(".json.tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(json.dumps(meta))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self._artifact_meta(session.id))
        session.artifact_tokens = list(tokens)

    def resumed(self, session: Session) -> None:
        if session.state == "parked":
            session.state = "open"
            self._append(session, {"op": "resume"})

    def close(self, session: Session) -> None:
        session.state = "closed"
        self._append(session, {"op": "close"})
        self._drop_artifact(session)

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
        for path in sorted((self.dir / "sessions").glob("*.jsonl")):
            session = _replay(path)
            if session is None:
                continue
            if session.state != "closed":
                session.artifact_tokens = self._read_artifact(session)
                if session.artifact_tokens:
                    session.state = "parked"
            self.sessions[session.id] = session
        if self.sessions:
            log.info("recovered %d sessions from %s", len(self.sessions), self.dir)
        return len(self.sessions)

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
            if kv_path.stat().st_size == 0:
                raise ValueError("empty KV file")
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("session %s: park artifact unusable (%s); its next turn prefills again",
                        session.id, exc)
            return None
        return tokens


def _replay(path: Path) -> Session | None:
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
                                      created=float(rec.get("created", 0)), owner=rec.get("owner"))
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
