"""The session API (/v1/sessions): conversations the server keeps, turn by turn.

A turn sends only its new messages; the server renders the whole history and the prefix cache
(or, after a restart, the session's park artifact) supplies the KV of the earlier turns, so a
turn costs the prefill of its new tokens only. See docs/sessions.md."""

from __future__ import annotations

import asyncio
import logging
import time

from aiohttp import web

from superfluid.core.config import CORE_OPTIONS
from superfluid.core.formats.conversation import Conversation
from superfluid.core.sessions import SessionConflict, SessionNotFound

from ..aliases import served_name
from ..lora import named_adapter
from ..body import read_as
from ..info.metrics import METRICS
from ..keys.auth import applied_class, check_model, may_see, note_class, request_key
from ..openai.chat_protocol import ChatMessage, kept_messages
from ..prepare.qos_class import request_class
from .protocol import SessionCreateRequest, SessionQosRequest, SessionTurnRequest
WINDOW_FILL = 0.5  # after a cut the kept history fills at most this share of the context, so cuts
                   # (each re-prefills what is kept once) are rare

log = logging.getLogger("superfluid.sessions")


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
        req = await read_as(request, SessionCreateRequest)
        served = served_name(request, req.model)
        runtime = self.daemon.get(served)
        check_model(request, runtime.name)
        if req.qos is not None:
            cls = applied_class(request, self.config, asked=req.qos)
        else:
            cls = request_class(request, self.config, otherwise=self.openai.preparer.aliases.qos(req.model))
        note_class(request, cls)
        key = request_key(request)  # the session belongs to the key that opened it
        # a session on MODEL:ADAPTER keeps that name: its turns, and its KV, are the adapter's
        session = self.store.create(served if named_adapter(runtime, served) else runtime.name, cls, req.system or None, pin_system=req.pin_system,
                                    owner=key.name if key is not None else None)
        self._pin(session, runtime)
        return web.json_response(session.view(), status=201)

    def _pin(self, session, runtime) -> None:
        """Pin the session's system prompt in the model's prefix cache, once per model loop:
        a model unloaded and loaded again starts with no pins."""
        if not session.pin_system or session.state == "closed" or session.pinned_by is runtime.loop:
            return
        if session.pinned_tokens is None:
            first = Conversation(kept_messages(session.history()[:1]))
            session.pinned_tokens = self.openai.preparer.chat_prefix_tokens(runtime, first)
        runtime.loop.pin_prefix(session.pinned_tokens)
        session.pinned_by = runtime.loop

    async def list(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list",
                                  "data": [s.view() for s in list(self.store.sessions.values())
                                           if may_see(request, s.owner)]})

    async def show(self, request: web.Request) -> web.Response:
        session = self._get(request, request.match_info["sid"])
        return web.json_response({**session.view(), "messages": session.messages})

    async def close(self, request: web.Request) -> web.Response:
        session = self._usable(request, request.match_info["sid"], idle=True)
        self.store.close(session)
        # the last turn's seal may still be writing the artifact: it is gone when this returns
        await asyncio.get_running_loop().run_in_executor(None, self.daemon.settle_closed_session, session)
        runtime = self.daemon.model_and_adapters(session.model)[0]
        if session.pinned_tokens is not None and runtime is not None and session.pinned_by is runtime.loop:
            runtime.loop.pin_prefix(session.pinned_tokens, pin=False)
        session.pinned_by = None
        return web.json_response({"id": session.id, "object": "session.deleted", "deleted": True})

    async def set_qos(self, request: web.Request) -> web.Response:
        session = self._usable(request, request.match_info["sid"])
        req = await read_as(request, SessionQosRequest)
        cls = applied_class(request, self.config, asked=req.qos)
        self.store.set_qos(session, note_class(request, cls))
        return web.json_response(session.view())

    async def park(self, request: web.Request) -> web.Response:
        session = self._usable(request, request.match_info["sid"], idle=True)
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, self.daemon.park_session, session)
        return web.json_response(session.view())

    async def turn(self, request: web.Request) -> web.StreamResponse:
        session = self._usable(request, request.match_info["sid"], idle=True)
        turn = await read_as(request, SessionTurnRequest)
        runtime = self.daemon.get(session.model)
        self.resume(session, runtime)
        await self.fit(session, runtime, turn)
        full = with_history(turn, session.history())

        def record(text: str, event, prompt_tokens: list[int], parsed) -> None:
            self.store.record_turn(session, stored(turn.messages), reply_message(text, parsed), prompt_tokens)

        session.busy = True
        turns = session.turns
        try:
            return await self.openai.generate_chat(request, full, session.model, qos=session.qos, on_finish=record)
        finally:
            session.busy = False
            if session.turns > turns:
                self.seal(session)

    def seal(self, session) -> None:
        """--park with --state-dir: the finished turn's KV goes to the session's park artifact in
        the background (the next tick writes it), so a daemon killed afterwards restores it warm."""
        if self.store.dir is None:
            return
        runtime = self.daemon.model_and_adapters(session.model)[0]
        if runtime is None or not CORE_OPTIONS.of(runtime.config).park:
            return

        def run() -> None:
            start = time.monotonic()
            try:
                tokens = self.daemon.seal_session(session)
            except Exception:  # a seal that fails leaves the previous artifact; never the turn's business
                log.exception("session %s: sealing its KV failed", session.id)
                return
            if tokens:
                METRICS.seal_seconds.labels(session.model).observe(time.monotonic() - start)

        asyncio.get_running_loop().run_in_executor(None, run)

    def resume(self, session, runtime) -> None:
        """Ready a session for a turn on ``runtime``: its system prompt pinned, its park artifact
        taken into the host tier (restored instead of prefilled), a parked session open again."""
        self._pin(session, runtime)
        if session.artifact_tokens and session.artifact_adopted_by is not runtime.loop:
            # restored instead of prefilled (again after a reload: the old host tier is gone)
            adapters = self.daemon.model_and_adapters(session.model)[1]  # the artifact's LoRA set
            lora = {"adapters": adapters} if adapters else {}
            if runtime.loop.adopt_prefix(session.artifact_tokens, self.store.artifact_path(session.id), **lora):
                session.artifact_adopted_by = runtime.loop
        self.store.resumed(session)

    async def fit(self, session, runtime, turn, overflow: str | None = None, build=None) -> None:
        """--session-overflow truncate: when the history and this turn's new messages leave no room
        for the reply (``max_tokens``, else an eighth of the context), leave the oldest messages
        out of the prompt (the system prompt and the first user message stay) until the prompt
        fills at most half the context. If nothing fits, the turn fails as a chat would (400).
        ``overflow`` stands in for --session-overflow; ``build(start)``: the turn's whole chat
        request with the history from window start ``start`` (default: the history, then the
        turn's messages), for a front end whose prompt holds more (the Responses API's
        instructions)."""
        overflow = overflow if overflow is not None else CORE_OPTIONS.of(self.config).session_overflow
        if overflow != "truncate" or not session.messages:
            return
        if build is None:
            def build(start):
                return with_history(turn, session.history(start))
        ctx = runtime.loop.settings.context_length
        asked = turn.max_completion_tokens if turn.max_completion_tokens is not None else turn.max_tokens
        reserve = asked if asked is not None and asked < ctx else ctx // 8
        loop = asyncio.get_running_loop()
        lengths: dict[int | None, int] = {}  # by window start: each is rendered and tokenized once

        def length(start: int | None) -> int:
            if start not in lengths:
                lengths[start] = self.openai.preparer.chat_prompt_length(build(start), session.model)
            return lengths[start]

        before = await loop.run_in_executor(None, length, None)
        if before + reserve <= ctx:
            return
        cuts = session.window_cuts()
        budget = min(int(ctx * WINDOW_FILL), ctx - reserve)
        lo, hi, best = 0, len(cuts) - 1, None
        while lo <= hi:  # the earliest cut under budget (the prompt shrinks as the cut moves on)
            mid = (lo + hi) // 2
            if await loop.run_in_executor(None, length, cuts[mid]) <= budget:
                best, hi = mid, mid - 1
            else:
                lo = mid + 1
        if best is None:
            if not cuts or await loop.run_in_executor(None, length, cuts[-1]) + reserve > ctx:
                return  # even the newest messages alone do not fit: the turn answers 400
            best = len(cuts) - 1
        self.store.drop_before(session, cuts[best])
        after = length(cuts[best])  # the prompt from the new window start, measured by the search
        log.info("session %s: the history (%d tokens + %d for the reply) outgrew the %d-token context; "
                 "left its oldest messages out (%d dropped in all), %d tokens kept",
                 session.id, before, reserve, ctx, session.dropped_messages, after)

    def _get(self, request, sid: str):
        """The session, if the request's key may see it: another key's session is a 404, as if
        it did not exist (admin keys see every session)."""
        session = self.store.get(sid)
        if not may_see(request, session.owner):
            raise SessionNotFound(f"No session with id {sid!r}", param="session_id")
        return session

    def _usable(self, request, sid: str, idle: bool = False):
        session = self._get(request, sid)
        if session.state == "closed":
            raise SessionConflict(f"session {sid} is closed", param="session_id", code="session_closed")
        if idle and session.busy:
            raise SessionConflict(f"a turn is already running on session {sid}; wait for it to finish",
                                  param="session_id", code="session_busy")
        return session


def stored(messages: list[ChatMessage]) -> list[dict]:
    """Messages as a session keeps them (and shows them): what the client sent of the fields
    the server reads."""
    return [m.model_dump(exclude_unset=True, by_alias=True) for m in messages]


def reply_message(text: str, parsed) -> dict:
    """A turn's reply as the session keeps it: the text, or with tool calls (the same call ids
    the client was given) the content outside them and the calls."""
    if parsed is not None and parsed.calls:
        return {"role": "assistant", "content": parsed.content, "tool_calls": parsed.calls}
    return {"role": "assistant", "content": text}


def with_history(turn: SessionTurnRequest, history: list[dict]) -> SessionTurnRequest:
    """The turn with the kept history before its new messages (each kept message was checked
    when its turn was sent)."""
    return turn.model_copy(update={"messages": [ChatMessage.model_validate(m) for m in history] + turn.messages})
