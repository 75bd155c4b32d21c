"""POST /v1/completions, /v1/chat/completions and /infill: prepare, submit, answer.

A handler reads the body, has it validated once into a :class:`~.prepare.Prepared` value, submits
its Request and answers from the lane's events, whole (:meth:`OpenAIRoutes._collect`) or as SSE
(:meth:`OpenAIRoutes._stream`); the bodies themselves are shaped in :mod:`.responses`."""

from __future__ import annotations

import asyncio
import time

from aiohttp import web

from . import params, tool_parse
from .access_log import log_generation
from .auth import door_time, request_key
from .bridge import EventBridge
from .key_limits import HEADERS, KeyLimits
from .metrics import METRICS
from .prepare import Prepared, Preparer
from .responses import DONE, Shape, error_body, error_reply, sse, status_of


class OpenAIRoutes:
    def __init__(self, daemon, config, catchup=None):
        self.daemon = daemon
        self.config = config
        self.catchup = catchup  # the front end's LoopCatchup: its bridges count wake-ups on it
        self.preparer = Preparer(daemon, config)
        self.key_limits = KeyLimits(metrics=METRICS)  # per-key requests/tokens per minute and lanes

    def add_to(self, app: web.Application) -> None:
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/infill", self.infill)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "chat")

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "completion")

    async def infill(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "infill")

    async def generate_chat(self, request: web.Request, body: dict, qos: str, on_finish) -> web.StreamResponse:
        """A chat completion for another route (a session's turn): ``body`` instead of the
        request's JSON, a fixed QoS class, and ``on_finish(text, event, prompt_tokens, parsed)``
        (``parsed``: the reply split into content and tool calls, when tools were offered)."""
        return await self._generate(request, "chat", body=body, qos=qos, on_finish=on_finish)

    def _sink(self, stream: bool) -> EventBridge:
        """A Request's sink: a streamed reply's deltas wake the loop as they come, a whole one's
        wait for its end."""
        return EventBridge(asyncio.get_running_loop(), hold_deltas=not stream, catchup=self.catchup)

    async def _generate(self, request: web.Request, kind: str, body: dict | None = None,
                        qos: str | None = None, on_finish=None) -> web.StreamResponse:
        """Run one generation. ``body`` (default: the request's JSON) and ``qos`` (default: from the
        headers) let other routes (sessions) reuse this; ``on_finish`` hears the complete reply
        before the response ends (see :meth:`generate_chat`)."""
        arrived = time.monotonic()
        if body is None:
            body = await params.read_body(request)
        prep = self.preparer.prepare(request, body, kind, arrived=arrived, make_sink=self._sink, qos=qos)
        req, scheduler = prep.request, prep.runtime.scheduler
        key = request_key(request)
        if key is not None:
            request[HEADERS] = (self.key_limits, key)  # x-ratelimit-* on the response, 429 or not
        # a lane slot, a request and the prompt's tokens of the key's budgets, or a 429
        with door_time():
            ticket = self.key_limits.admit(key, len(req.prompt_tokens))
        answer = _Answer(prep, Shape(kind, prep.runtime.name), on_finish)
        try:
            try:
                scheduler.submit(req)  # a prompt longer than the context is refused here (a 400)
            except BaseException:
                with door_time():
                    ticket.end(0, refund_prompt=True)  # never queued: it costs a request, not its tokens
                raise
            try:
                if prep.stream:
                    return await self._stream(request, answer)
                return await self._collect(request, answer)
            except (ConnectionResetError, asyncio.CancelledError):
                # The client went away: the lane is cancelled below and frees its KV at the next step.
                answer.log(request, 499, finish="disconnected")
                raise
            finally:
                if not prep.bridge.done:
                    scheduler.cancel(req.id)
        finally:
            with door_time():  # whatever the outcome: the lane slot back, the completion charged
                ticket.end(answer.generated)

    async def _collect(self, request, answer: "_Answer") -> web.Response:
        prep, text = answer.prep, []
        async for event in prep.bridge.events():
            answer.count(event)
            if event.kind == "delta":
                text.append(event.text)
            elif event.kind == "error":
                answer.log(request, status_of(event.error), event=event, finish="error")
                return error_reply(event.error)
            elif event.kind == "finished":
                answer.log(request, 200, event=event)
                reply = prep.tools.prefill + "".join(text)  # the pre-fill is "" unless a call is forced
                parsed = tool_parse.parse(reply, event.finish_reason, prep.tools) if prep.tools.active else None
                answer.finished(reply, event, parsed)
                return web.json_response(answer.shape.whole(reply, event, parsed))
        raise AssertionError("event stream ended without a final event")

    async def _stream(self, request, answer: "_Answer") -> web.StreamResponse:
        prep, shape, streamed = answer.prep, answer.shape, []
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        await resp.prepare(request)
        if shape.kind == "chat":
            await resp.write(sse(shape.chunk(role=True)))
        parser = tool_parse.StreamParser(prep.tools) if prep.tools.active else None
        async for event in prep.bridge.events():
            answer.count(event)
            if event.kind == "delta":
                if event.text:
                    streamed.append(event.text)
                    text = parser.feed(event.text) if parser else event.text
                    if text:
                        await resp.write(sse(shape.chunk(text=text)))
            elif event.kind == "error":
                answer.log(request, status_of(event.error), event=event, finish="error")
                await resp.write(sse(error_body(event.error)))
                break
            elif event.kind == "finished":
                finish, parsed = event.finish_reason, None
                if parser:  # what was held back: the rest of the content, then the calls whole
                    rest, parsed = parser.finish(finish)
                    if rest:
                        await resp.write(sse(shape.chunk(text=rest)))
                    if parsed.calls:
                        await resp.write(sse(shape.chunk(tool_calls=tool_parse.stream_deltas(parsed.calls))))
                    finish = parsed.finish_reason
                answer.finished(prep.tools.prefill + "".join(streamed), event, parsed)
                await resp.write(sse(shape.chunk(finish=finish, event=event)))
                if prep.include_usage:
                    await resp.write(sse(shape.usage_chunk(event)))
                answer.log(request, 200, event=event)
        if shape.kind != "infill":
            await resp.write(DONE)
        await resp.write_eof()
        return resp


class _Answer:
    """One generation being answered: its prepared request, response shape, finish callback."""

    def __init__(self, prep: Prepared, shape: Shape, on_finish=None):
        self.prep = prep
        self.shape = shape
        self.on_finish = on_finish  # on_finish(text, event, prompt_tokens, parsed): for a session's log
        self.generated = 0  # completion tokens seen so far: what the key's tokens-per-minute is charged

    def count(self, event) -> None:
        if event.kind == "delta":
            self.generated += len(event.token_ids)
        elif event.kind == "finished":
            self.generated = max(self.generated, event.completion_tokens)

    def finished(self, text: str, event, parsed=None) -> None:
        if self.on_finish is not None:
            self.on_finish(text, event, self.prep.request.prompt_tokens, parsed)

    def log(self, request, status: int, *, event=None, finish: str | None = None) -> None:
        """The access-log line: ``event`` the final one (none for a client that left); a failure
        (``finish`` given) is logged with no completion tokens."""
        req = self.prep.request
        completion = 0 if finish is not None or event is None else event.completion_tokens
        log_generation(request, status=status, model=self.prep.runtime.name, qos=req.qos,
                       prompt_tokens=len(req.prompt_tokens), arrived=req.arrived, completion_tokens=completion,
                       timings=event.timings if event is not None else {},
                       finish=finish if finish is not None else event.finish_reason)
