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
session."""

from __future__ import annotations

from superfluid.core.errors import InvalidRequest, SuperfluidError
from superfluid.core.sessions import SessionConflict, SessionStore

from ..keys.auth import may_see, request_key


class ResponseNotFound(SuperfluidError):
    status = 404
    type = "invalid_request_error"
    code = "response_not_found"


class Chains:
    """Response id → (session id, turn number), over the sessions' kept responses."""

    def __init__(self, store: SessionStore):
        self.store = store
        self._index: dict[str, tuple[str, int]] | None = None  # built on first use, from the sessions

    def _ids(self) -> dict[str, tuple[str, int]]:
        if self._index is None:  # the sessions recovered from their logs hold their responses
            self._index = {extra["response"]["id"]: (session.id, n)
                           for session in list(self.store.sessions.values())
                           for n, extra in session.extras.items() if "response" in extra}
        return self._index

    def find(self, request, response_id: str, param: str = "response_id"):
        """(session, turn number, response object) of a stored response the request's key may see;
        else a 404."""
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
               prompt_tokens: list[int], response: dict):
        """Keep a finished response as a turn: of ``session``, or of a new session (None)."""
        if session is None:
            key = request_key(request)
            session = self.store.create(model, qos, None, owner=key.name if key is not None else None)
        self.store.record_turn(session, new, reply, prompt_tokens, extra={"response": response})
        self._ids()[response["id"]] = (session.id, session.turns)
        return session

    def delete(self, request, response_id: str) -> None:
        """Forget a stored response; the latest of an open session closes the session too."""
        session, n, _ = self.find(request, response_id)
        if session.busy:
            raise SessionConflict(f"a response is running in the conversation of {response_id}; wait for it to "
                                  f"finish", param="response_id", code="session_busy")
        self.store.forget_extra(session, n)
        self._ids().pop(response_id, None)
        if n == session.turns and session.state != "closed":
            self.store.close(session)
