"""Stored responses on superfluid's sessions: a response with ``store`` true is a session turn.

A stored response without ``previous_response_id`` opens a session (owned by the request's key,
as ``POST /v1/sessions`` does, in the class the response ran at); one with it continues that
response's session, so only the new items are sent and prefilled, the history comes from the
session and its KV from the prefix cache (or, after a restart, the park artifact). The response
object is kept with its turn (:attr:`~superfluid.core.sessions.Session.extras`, written to the
session's log), so ``GET`` and ``previous_response_id`` work after a restart with
``--state-dir``.

Rules (docs/api.md): ``previous_response_id`` must name the latest response of its session (an
older one is a 400 that names the latest: a session is one line of turns, not a tree); another
key's response is a 404, as if it did not exist; deleting a session's latest response closes the
session.

Retention (``--responses-ttl``, ``--responses-max``): a stored response kept longer than the TTL
(counted from when it was stored, as it finished), or the oldest while more than the cap are
stored, is evicted: a 404 from then on, with a log line.
Its turn stays in its conversation while the conversation holds another stored response; once
it holds none (no one can continue it), the session the Responses API opened is removed,
its log and park artifact deleted. A session opened by ``POST /v1/sessions`` is never removed.
Evictions run whenever the store is used and on a timer (:meth:`Chains.sweep`)."""

from __future__ import annotations

import logging
import time

from superfluid.core.errors import InvalidRequest, SuperfluidError
from superfluid.core.sessions import SessionConflict, SessionStore

from ..keys.auth import may_see, request_key

log = logging.getLogger("superfluid.responses")
ORIGIN = "responses"  # the sessions this API opens (Session.origin)


class ResponseNotFound(SuperfluidError):
    status = 404
    type = "invalid_request_error"
    code = "response_not_found"


class Chains:
    """Response id → (session id, turn number), over the sessions' kept responses."""

    def __init__(self, store: SessionStore, ttl: float = 0.0, cap: int = 0, clock=time.time):
        self.store = store
        self.ttl = ttl      # seconds a stored response is kept (0: no expiry)
        self.cap = cap      # most stored responses (0: no cap)
        self.clock = clock
        # response id -> (session id, turn), oldest first; and when each was stored
        self._index: dict[str, tuple[str, int]] | None = None  # built on first use, from the sessions
        self._born: dict[str, float] = {}

    def _ids(self) -> dict[str, tuple[str, int]]:
        if self._index is None:  # the sessions recovered from their logs hold their responses
            kept = sorted((float(extra.get("stored_at") or extra["response"].get("created_at") or session.created),
                           extra["response"]["id"], session.id, n)
                          for session in list(self.store.sessions.values())
                          for n, extra in session.extras.items() if "response" in extra)
            self._index = {rid: (sid, n) for _, rid, sid, n in kept}
            self._born = {rid: born for born, rid, _, _ in kept}
        return self._index

    # ---- retention ---------------------------------------------------------------------------

    def sweep(self) -> int:
        """Evict what is past the TTL or over the cap, oldest first; how many were evicted."""
        ids = self._ids()
        now = self.clock()
        evicted = 0
        while ids:
            oldest = next(iter(ids))
            expired = self.ttl > 0 and now - self._born.get(oldest, now) > self.ttl
            over = self.cap > 0 and len(ids) > self.cap
            if not (expired or over):
                break
            why = (f"older than --responses-ttl {self.ttl:g}s" if expired
                   else f"over --responses-max {self.cap}, the oldest")
            self._evict(oldest, why)
            evicted += 1
        return evicted

    def _evict(self, response_id: str, why: str) -> None:
        sid, n = self._ids().pop(response_id)
        self._born.pop(response_id, None)
        session = self.store.sessions.get(sid)
        if session is None:
            return
        left = [k for k, extra in session.extras.items() if k != n and "response" in extra]
        if not left and not session.busy and _opened_here(session):
            log.info("stored response %s evicted (%s); its conversation %s holds no other, so it is removed",
                     response_id, why, sid)
            self.store.remove(session)
            return
        log.info("stored response %s evicted (%s); its conversation %s keeps the turn", response_id, why, sid)
        self.store.forget_extra(session, n)

    def find(self, request, response_id: str, param: str = "response_id"):
        """(session, turn number, response object) of a stored response the request's key may see;
        else a 404."""
        self.sweep()
        where = self._ids().get(response_id)
        session = self.store.sessions.get(where[0]) if where is not None else None
        extra = session.extras.get(where[1]) if session is not None else None
        if extra is None or not may_see(request, session.owner):
            raise ResponseNotFound(f"Response with id {response_id!r} not found.", param=param)
        return session, where[1], extra["response"]

    def latest(self, request, response_id: str, *, idle: bool):
        """The session ``previous_response_id`` continues: it must be open (not closed), hold no
        running turn when ``idle`` (a stored continuation), and ``response_id`` must be its
        latest turn."""
        session, n, _ = self.find(request, response_id, param="previous_response_id")
        if session.state == "closed":
            raise SessionConflict(f"the conversation of response {response_id} was closed (its latest response or "
                                  f"its session {session.id} was deleted)", param="previous_response_id",
                                  code="session_closed")
        if n != session.turns:
            newer = session.extras.get(session.turns, {}).get("response", {}).get("id")
            later = (f"continue from the latest, {newer}" if newer else
                     f"its session {session.id} has had turns since")
            raise InvalidRequest(f"response {response_id} is not the latest of its conversation: {later}, or send "
                                 f"the whole conversation as input with store: false", param="previous_response_id",
                                 code="invalid_value")
        if idle and session.busy:
            raise SessionConflict(f"a response is already running in the conversation of {response_id}; wait for "
                                  f"it to finish", param="previous_response_id", code="session_busy")
        return session

    def record(self, request, session, *, model: str, qos: str, new: list[dict], reply: dict,
               prompt_tokens: list[int], response: dict, input_items: list[dict] = ()):
        """Keep a finished response (and its input items, for ``input_items``) as a turn: of
        ``session``, or of a new session (None); then evict what retention says is too much."""
        if session is None:
            key = request_key(request)
            session = self.store.create(model, qos, None, owner=key.name if key is not None else None,
                                        origin=ORIGIN)
        now = self.clock()
        self.store.record_turn(session, new, reply, prompt_tokens,
                               extra={"response": response, "input": list(input_items), "stored_at": now})
        self._ids()[response["id"]] = (session.id, session.turns)
        self._born[response["id"]] = now
        self.sweep()
        return session

    def input_items(self, request, response_id: str) -> list[dict]:
        """The input items a stored response was asked with (a 404 as :meth:`find`)."""
        session, n, _ = self.find(request, response_id)
        return session.extras[n].get("input") or []

    def delete(self, request, response_id: str):
        """Forget a stored response; the latest of an open session closes the session too. The
        session it closed, else None."""
        session, n, _ = self.find(request, response_id)
        if session.busy:
            raise SessionConflict(f"a response is running in the conversation of {response_id}; wait for it to "
                                  f"finish", param="response_id", code="session_busy")
        self.store.forget_extra(session, n)
        self._ids().pop(response_id, None)
        if n == session.turns and session.state != "closed":
            self.store.close(session)
            return session
        return None


def _opened_here(session) -> bool:
    """Whether the Responses API opened ``session`` (a log written before Session.origin was
    kept: its first turn is a stored response)."""
    if session.origin is not None:
        return session.origin == ORIGIN
    return "response" in session.extras.get(1, {}) and session.system is None
