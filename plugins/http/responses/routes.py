"""The Responses API's routes: ``POST /v1/responses`` (create), ``GET`` and ``DELETE
/v1/responses/{response_id}``, ``GET /v1/responses/{response_id}/input_items``, ``POST
/v1/responses/{response_id}/cancel`` and ``POST /v1/responses/input_tokens``.

A response is a chat completion run by the OpenAI routes (:meth:`~..openai.routes.OpenAIRoutes.generate_chat`:
the same preparation, admission, key limits, QoS and errors) with the :class:`.wire.ResponsesWire`
writing its reply; a stored one is a session turn (:mod:`.chains`), which is where the session
rules (ownership, one running turn, resuming a parked session, the history window) come from."""

from __future__ import annotations

import asyncio
import logging
import time

from aiohttp import web

from superfluid.core.config import CORE_OPTIONS
from superfluid.core.errors import InvalidRequest

from ..body import read_as
from ..keys.auth import check_model, may_see, request_key
from ..manage.sessions import SessionRoutes, reply_message
from .chains import Chains
from .input_items import input_item_objects, page
from .mapping import chat_request, input_messages, stored
from .objects import ResponseShape
from .protocol import ResponsesInput, ResponsesInputTokensRequest, ResponsesRequest
from .wire import ResponsesWire

CANCEL_WAIT = 30.0  # seconds a cancel waits for the cancelled generation to end (within a tick, as a rule)
log = logging.getLogger("superfluid.responses")
SWEEP_EVERY = 60.0  # seconds between retention sweeps with no traffic (a shorter --responses-ttl: a tenth of it)


class _Running:
    """A response in flight: its wire (what it said so far; its lanes, once prepared), who owns
    it, whether it will be stored, and an event set when its handler ends."""

    def __init__(self, wire: ResponsesWire, owner: str | None, stored: bool):
        self.wire = wire
        self.owner = owner
        self.stored = stored
        self.done = asyncio.Event()


class _Reply:
    """The finished reply as the session keeps it, heard before the response object is built."""

    def __init__(self):
        self.message: dict | None = None
        self.prompt_tokens: list[int] = []
        self.session = None  # the session it was kept in (store: true)


class ResponsesRoutes:
    def __init__(self, daemon, config, openai):
        self.daemon = daemon
        self.config = config
        self.openai = openai  # runs the generation: the chat path, with this API's wire
        self.sessions = SessionRoutes(daemon, config, openai)  # the session rules (its routes are added once, elsewhere)
        core = CORE_OPTIONS.of(config)
        self.chains = Chains(daemon.sessions, ttl=core.responses_ttl, cap=core.responses_max)
        self.running: dict[str, _Running] = {}

    def add_to(self, app: web.Application) -> None:
        app.router.add_post("/v1/responses", self.create)
        app.router.add_post("/v1/responses/input_tokens", self.input_tokens)
        app.router.add_get("/v1/responses/{response_id}", self.show)
        app.router.add_get("/v1/responses/{response_id}/input_items", self.input_items)
        app.router.add_delete("/v1/responses/{response_id}", self.delete)
        app.router.add_post("/v1/responses/{response_id}/cancel", self.cancel)
        app.cleanup_ctx.append(self._sweeping)

    async def _sweeping(self, app):
        """Retention runs with no traffic too, so an idle daemon frees what expired."""
        ttl = self.chains.ttl
        every = min(SWEEP_EVERY, max(ttl / 10, 0.5)) if ttl > 0 else SWEEP_EVERY

        async def run():
            while True:
                try:
                    self.chains.sweep()
                except Exception as exc:  # the next sweep retries
                    log.warning("stored responses: the retention sweep failed (%s)", exc)
                await asyncio.sleep(every)

        task = asyncio.get_running_loop().create_task(run())
        yield
        task.cancel()
    # ---- create ------------------------------------------------------------------------------

    async def create(self, request: web.Request) -> web.StreamResponse:
        arrived = time.monotonic()
        req = await read_as(request, ResponsesRequest)
        session, runtime = self._continued(request, req, idle=bool(req.store))
        holds = session is not None and bool(req.store)  # a stored continuation: one turn at a time
        if holds:
            session.busy = True
        try:
            new = input_messages(req)
            chat = await self._chat(req, new, session, runtime)
            reply = _Reply()
            wire = None

            def finished(text: str, event, prompt_tokens: list[int], parsed) -> None:
                reply.message, reply.prompt_tokens = reply_message(text, parsed), prompt_tokens

            def responded(response: dict) -> None:
                if req.store and reply.message is not None:
                    prep = wire.prep
                    reply.session = self.chains.record(
                        request, session, model=prep.runtime.name, qos=prep.request.qos, new=stored(new),
                        reply=reply.message, prompt_tokens=reply.prompt_tokens, response=response,
                        input_items=input_item_objects(req))

            wire = ResponsesWire(ResponseShape(req), on_response=responded)
            key = request_key(request)
            rid = wire.shape.id
            running = self.running[rid] = _Running(wire, key.name if key is not None else None, bool(req.store))
            try:
                return await self.openai.generate_chat(
                    request, chat, session.model if session is not None else None,
                    qos=session.qos if session is not None else None, on_finish=finished, wire=wire,
                    arrived=arrived, limit_is_ceiling=True)
            finally:
                self.running.pop(rid, None)
                running.done.set()
                if reply.session is not None:  # --park: its KV sealed to the state dir
                    self.sessions.seal(reply.session)
        finally:
            if holds:
                session.busy = False

    def _continued(self, request, req: ResponsesInput, idle: bool):
        """(session, runtime) ``previous_response_id`` continues, or (None, None)."""
        if req.previous_response_id is None:
            return None, None
        session = self.chains.latest(request, req.previous_response_id, idle=idle)
        runtime = self.daemon.get(session.model)
        check_model(request, runtime.name)
        asked = self.openai.preparer.aliases.model(req.model) if req.model else None
        if asked is not None and asked != session.model:
            raise InvalidRequest(f"model {req.model!r} cannot continue response {req.previous_response_id}: its "
                                 f"conversation runs on {session.model!r}", param="model", code="invalid_value")
        return session, runtime

    async def _chat(self, req: ResponsesInput, new: list, session, runtime):
        """The chat request the response runs: alone, or after its session's history (which, with
        ``truncation: auto``, drops its oldest messages when it outgrows the context)."""
        if session is None:
            return chat_request(req, new=new)
        self.sessions.resume(session, runtime)
        req = req.model_copy(update={"model": None})  # the session's model runs it

        def build(start: int | None = None):
            return chat_request(req, session.history(start), new)

        if req.truncation == "auto":
            await self.sessions.fit(session, runtime, build(), overflow="truncate", build=build)
        return build()

    # ---- the other routes --------------------------------------------------------------------

    async def input_tokens(self, request: web.Request) -> web.Response:
        """How many tokens the response's prompt would be (``usage.input_tokens`` of its run)."""
        req = await read_as(request, ResponsesInputTokensRequest)
        session, runtime = self._continued(request, req, idle=False)
        new = input_messages(req)
        if session is None:
            chat, model = chat_request(req, new=new), None
            check_model(request, self.daemon.get(self.openai.preparer.aliases.model(req.model)).name)
        else:
            req = req.model_copy(update={"model": None})
            chat, model = chat_request(req, session.history(), new), session.model
        count = await asyncio.get_running_loop().run_in_executor(
            None, self.openai.preparer.chat_prompt_length, chat, model)
        return web.json_response({"object": "response.input_tokens", "input_tokens": count})

    def _in_flight(self, request, response_id: str, stored_only: bool = False) -> _Running | None:
        running = self.running.get(response_id)
        if running is None or not may_see(request, running.owner) or (stored_only and not running.stored):
            return None
        return running

    async def show(self, request: web.Request) -> web.Response:
        response_id = request.match_info["response_id"]
        running = self._in_flight(request, response_id, stored_only=True)
        if running is not None:
            return web.json_response(running.wire.snapshot())
        return web.json_response(self.chains.find(request, response_id)[2])

    async def input_items(self, request: web.Request) -> web.Response:
        """The input items of a stored response, paged as OpenAI pages them (:mod:`.input_items`)."""
        items = self.chains.input_items(request, request.match_info["response_id"])
        return web.json_response(page(items, request.query))

    async def delete(self, request: web.Request) -> web.Response:
        response_id = request.match_info["response_id"]
        closed = self.chains.delete(request, response_id)
        if closed is not None:  # its last turn's seal may still be writing the park artifact
            await asyncio.get_running_loop().run_in_executor(None, self.daemon.settle_closed_session, closed)
        return web.json_response({"id": response_id, "object": "response", "deleted": True})

    async def cancel(self, request: web.Request) -> web.Response:
        """Cancel a response in flight (the client streaming it learnt its id from
        ``response.created``): its lanes stop at the engine's next step and it ends with status
        ``cancelled``, what it generated kept. A finished stored response comes back unchanged."""
        response_id = request.match_info["response_id"]
        running = self._in_flight(request, response_id)
        if running is None:
            return web.json_response(self.chains.find(request, response_id)[2])
        prep = running.wire.prep
        if prep is not None:
            for req in prep.requests:
                prep.runtime.loop.cancel(req.id)
        try:
            await asyncio.wait_for(running.done.wait(), CANCEL_WAIT)
        except asyncio.TimeoutError:
            pass
        return web.json_response(running.wire.snapshot("cancelled"))
