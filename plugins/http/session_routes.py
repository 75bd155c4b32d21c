"""The session API (/v1/sessions): conversations the server keeps, turn by turn.

A turn sends only its new messages; the server renders the whole history and the prefix cache
(or, after a restart, the session's park artifact) supplies the KV of the earlier turns, so a
turn costs the prefill of its new tokens only. See docs/sessions.md."""

from __future__ import annotations

import asyncio

from aiohttp import web

from superfluid.core import qos as qos_classes
from superfluid.core.errors import InvalidRequest
from superfluid.core.sessions import SessionConflict

from . import params
from .openai_routes import read_body, request_class

CREATE_FIELDS = {"model", "qos", "system", "pin_system"}
TURN_FIELDS = params.CHAT_FIELDS - {"model"}


class SessionRoutes:
    def __init__(self, daemon, config, openai):
        self.daemon = daemon
        self.store = daemon.sessions
        self.config = config
        self.openai = openai  # runs the turns: same validation, streaming and errors as chat

    def add_to(self, app: web.Application) -> None:
        app.router.add_post("/v1/sessions", self.create)
        app.router.add_get("/v1/sessions", self.list)
        app.router.add_get("/v1/sessions/{sid}", self.show)
        app.router.add_delete("/v1/sessions/{sid}", self.close)
        app.router.add_post("/v1/sessions/{sid}/turns", self.turn)
        app.router.add_post("/v1/sessions/{sid}/qos", self.set_qos)
        app.router.add_post("/v1/sessions/{sid}/park", self.park)

    async def create(self, request: web.Request) -> web.Response:
        body = params.check_fields(await read_body(request), CREATE_FIELDS)
        model = body.get("model")
        if model is not None and not isinstance(model, str):
            raise InvalidRequest("model must be a string", param="model", code="invalid_type")
        runtime = self.daemon.get(model)
        if "qos" in body:
            if not isinstance(body["qos"], str):
                raise InvalidRequest("qos must be a string", param="qos", code="invalid_type")
            cls = qos_classes.resolve(body["qos"], param="qos")
        else:
            cls = request_class(request, self.config)
        system = params.text(body, "system") or None
        pin = params.boolean(body, "pin_system")
        if pin and not system:
            raise InvalidRequest("pin_system needs a system prompt", param="pin_system", code="invalid_value")
        session = self.store.create(runtime.name, cls, system, pin_system=pin)
        self._pin(session, runtime)
        return web.json_response(session.view(), status=201)

    def _pin(self, session, runtime) -> None:
        """Pin the session's system prompt in this process's prefix cache (once)."""
        if session.pin_system and session.pinned_tokens is None and session.state != "closed":
            session.pinned_tokens = self.openai.chat_prefix_tokens(runtime, session.history()[:1])
            runtime.scheduler.pin_prefix(session.pinned_tokens)

    async def list(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list",
                                  "data": [s.view() for s in list(self.store.sessions.values())]})

    async def show(self, request: web.Request) -> web.Response:
        session = self.store.get(request.match_info["sid"])
        return web.json_response({**session.view(), "messages": session.messages})

    async def close(self, request: web.Request) -> web.Response:
        session = self._usable(request.match_info["sid"], idle=True)
        self.store.close(session)
        if session.pinned_tokens is not None and session.model in self.daemon.models:
            self.daemon.models[session.model].scheduler.pin_prefix(session.pinned_tokens, pin=False)
        return web.json_response({"id": session.id, "object": "session.deleted", "deleted": True})

    async def set_qos(self, request: web.Request) -> web.Response:
        session = self._usable(request.match_info["sid"])
        body = params.check_fields(await read_body(request), {"qos"})
        if not isinstance(body.get("qos"), str):
            raise InvalidRequest("qos is required (a class name)", param="qos", code="invalid_type")
        self.store.set_qos(session, qos_classes.resolve(body["qos"], param="qos"))
        return web.json_response(session.view())

    async def park(self, request: web.Request) -> web.Response:
        session = self._usable(request.match_info["sid"], idle=True)
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, self.daemon.park_session, session)
        return web.json_response(session.view())

    async def turn(self, request: web.Request) -> web.StreamResponse:
        session = self._usable(request.match_info["sid"], idle=True)
        body = params.check_fields(await read_body(request), TURN_FIELDS)
        params.chat_messages(body)  # validates the new messages (400s name the field)
        runtime = self.daemon.get(session.model)
        self._pin(session, runtime)
        if session.artifact_tokens and not session.artifact_loaded:  # restored instead of prefilled
            session.artifact_loaded = runtime.scheduler.adopt_prefix(
                session.artifact_tokens, self.store.artifact_path(session.id))
        self.store.resumed(session)
        full = {**body, "model": session.model, "messages": session.history() + body["messages"]}

        def record(text: str, event, prompt_tokens: list[int], parsed) -> None:
            reply = {"role": "assistant", "content": text}
            if parsed is not None and parsed.calls:  # the same call ids the client was given
                reply = {"role": "assistant", "content": parsed.content, "tool_calls": parsed.calls}
            self.store.record_turn(session, list(body["messages"]), reply, prompt_tokens)

        session.busy = True
        try:
            return await self.openai.generate_chat(request, full, qos=session.qos, on_finish=record)
        finally:
            session.busy = False

    def _usable(self, sid: str, idle: bool = False):
        session = self.store.get(sid)
        if session.state == "closed":
            raise SessionConflict(f"session {sid} is closed", param="session_id", code="session_closed")
        if idle and session.busy:
            raise SessionConflict(f"a turn is already running on session {sid}; wait for it to finish",
                                  param="session_id", code="session_busy")
        return session
