"""POST /v1/completions, /v1/chat/completions and /infill: prepare, submit, answer.

A handler reads the body, has the preparation path validate it once into a ``Prepared`` value
(:mod:`..prepare.preparer`), submits its Requests (one per choice) and answers from the lanes'
events, whole (:meth:`OpenAIRoutes._collect`) or as SSE (:meth:`OpenAIRoutes._stream`); the
bodies themselves are shaped in :mod:`.replies`."""

from __future__ import annotations

import asyncio
import time

import attrs
from aiohttp import web

from superfluid.core.errors import InvalidRequest

from ..access_log import log_generation
from ..aliases import Aliases
from ..bridge import EventBridge
from ..body import read_as
from ..images import ImageLoader
from ..info.metrics import METRICS
from ..keys.auth import door_time, request_key
from ..keys.limits import HEADERS, KeyLimits
from ..prepare.logprob_format import TokenText
from ..prepare.preparer import Prepared, Preparer
from ..options import OPTIONS
from ..stall import ClientStalled, StallGuard
from ..wire import Wire
from .chat_protocol import ChatCompletionRequest, ChatFields
from .choices import Choice
from .protocol import CompletionRequest, InfillRequest
from .replies import Shape, status_of


class OpenAIRoutes:
    def __init__(self, daemon, config, catchup=None, aliases: Aliases | None = None):
        self.daemon = daemon
        self.config = config
        self.catchup = catchup  # the front end's LoopCatchup: its bridges count wake-ups on it
        self.preparer = Preparer(daemon, config, aliases=aliases)
        self.reasoning_field = OPTIONS.of(config).reasoning_field  # chat's name for the reasoning
        self.images = ImageLoader(config)
        self.key_limits = KeyLimits(metrics=METRICS)  # per-key requests/tokens per minute and lanes
        self.stall = StallGuard(OPTIONS.of(config).stream_stall_timeout)  # a stream nobody reads ends

    def add_to(self, app: web.Application) -> None:
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/infill", self.infill)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        arrived = time.monotonic()
        return await self._generate(request, await read_as(request, ChatCompletionRequest), arrived)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        arrived = time.monotonic()
        return await self._generate(request, await read_as(request, CompletionRequest), arrived)

    async def infill(self, request: web.Request) -> web.StreamResponse:
        arrived = time.monotonic()
        return await self._generate(request, await read_as(request, InfillRequest), arrived)

    async def generate_chat(self, request: web.Request, req, model: str | None = None, qos: str | None = None,
                            on_finish=None, *, wire: Wire | None = None, arrived: float | None = None,
                            limit_is_ceiling: bool = False) -> web.StreamResponse:
        """A chat completion for another route: a session's turn, or another API's request
        mapped onto chat. ``req``: its typed chat request (:class:`~.chat_protocol.ChatFields`);
        ``model`` and ``qos`` stand in for the request's own (a session's); ``on_finish(text,
        event, prompt_tokens, parsed)`` hears the complete reply (``parsed``: the reply split into
        content and tool calls, when tools were offered); ``wire`` answers in that API's format
        (default: OpenAI's); ``limit_is_ceiling``: the reply's token limit is a ceiling, cut to
        what the context leaves (Anthropic's ``max_tokens``), not a demand refused when the
        context cannot hold it (OpenAI's)."""
        return await self._generate(request, req, time.monotonic() if arrived is None else arrived, model=model,
                                    qos=qos, on_finish=on_finish, wire=wire, limit_is_ceiling=limit_is_ceiling)

    async def load_images(self, req, model: str | None = None) -> None:
        """Fetch, decode and check a chat's images as its model's processor sizes them (a 400 naming the
        first bad one; a text-only model refuses them all), before the request is prepared."""
        images = req.conversation.images() if isinstance(req, ChatFields) else []
        if not images:
            return
        runtime = self.preparer.chat_runtime(req, model)
        runtime.loop.check_takes_images()
        await self.images.load(images, runtime.engine.info.vision)

    def _sink(self, stream: bool, lanes: int = 1) -> EventBridge:
        """The sink of a reply's lanes (one per choice): a streamed reply's deltas wake the loop
        as they come, a whole one's wait for their lane's end."""
        return EventBridge(asyncio.get_running_loop(), hold_deltas=not stream, catchup=self.catchup, lanes=lanes)

    async def _generate(self, request: web.Request, req, arrived: float, model: str | None = None,
                        qos: str | None = None, on_finish=None, wire: Wire | None = None,
                        limit_is_ceiling: bool = False) -> web.StreamResponse:
        """Run one generation (``n`` lanes for n choices) of a typed request. ``model`` and
        ``qos`` (default: the request's and the headers') let other routes (sessions) reuse
        this; ``on_finish`` hears the complete reply before the response ends, ``wire`` writes
        it (see :meth:`generate_chat`)."""
        wire = wire if wire is not None else Wire(reasoning_field=self.reasoning_field)
        await self.load_images(req, model)
        prep = self.preparer.prepare(request, req, arrived=arrived, make_sink=self._sink, qos=qos, model=model,
                                     limit_is_ceiling=limit_is_ceiling)
        wire.prepared(prep)
        if on_finish is not None and len(prep.requests) > 1:
            raise InvalidRequest("a session turn has one reply: n must be 1", param="n", code="unsupported_value")
        reqs, scheduler = prep.requests, prep.runtime.loop
        key = request_key(request)
        if key is not None:
            request[HEADERS] = (self.key_limits, key)  # x-ratelimit-* on the response, 429 or not
        # per choice a lane slot and a request of the key's budgets, the prompt's tokens once; or a 429
        with door_time():
            tickets = _admit(self.key_limits, key, len(reqs[0].prompt_tokens), len(reqs))
        answer = _Answer(prep, Shape(prep.kind, prep.runtime.name), wire, on_finish)
        try:
            _submit(scheduler, reqs, tickets)  # a prompt longer than the context is refused here (a 400)
            try:
                if prep.stream:
                    return await self._stream(request, answer)
                return await self._collect(request, answer)
            except (ConnectionResetError, asyncio.CancelledError):
                # The client went away: the lanes are cancelled below and free their KV at the next step.
                answer.log(request, 499, finish="disconnected")
                raise
            finally:
                for i, req in enumerate(reqs):
                    if not prep.bridge.ended(i):
                        scheduler.cancel(req.id)
        finally:
            with door_time():  # whatever the outcome: the lane slots back, the completions charged
                for ticket, choice in zip(tickets, answer.choices):
                    ticket.end(choice.generated)

    async def _collect(self, request, answer: "_Answer") -> web.Response:
        prep, choices = answer.prep, answer.choices
        async for i, event in prep.bridge.tagged():
            if event.kind == "delta":
                choices[i].delta(event)
            elif event.kind == "error":
                answer.log(request, status_of(event.error), event=event, finish="error")
                return answer.wire.error(event.error)
            elif event.kind == "finished":
                choices[i].finish(event)
        events = [c.event for c in choices]
        answer.log(request, 200, event=answer.summed())
        answer.finished()
        if answer.shape.kind == "infill":
            return answer.wire.whole(answer.shape.whole(choices[0].reply, events[0]))
        scores = events[0].prompt_logprobs  # only the first choice's lane scores a prompt
        return answer.wire.whole(answer.shape.replies([c.whole(scores) for c in choices], events,
                                                      answer.reasoning_tokens()))

    async def _stream(self, request, answer: "_Answer") -> web.StreamResponse:
        prep, shape, choices, wire = answer.prep, answer.shape, answer.choices, answer.wire
        resp = web.StreamResponse(headers={"Content-Type": wire.content_type,
                                           "Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.stall.cap(request)
        await resp.prepare(request)
        try:
            async def send(data: bytes) -> None:
                await self.stall.write(request, resp, data)

            async def write(chunks) -> None:
                for chunk in chunks:
                    for data in wire.chunk(chunk):
                        await send(data)

            for data in wire.opening():
                await send(data)
            for choice in choices:
                await write(choice.opening())
            failed = False
            # An echoed prompt with logprobs goes first, once the scoring lane has computed it; what
            # the choices make before then is held back, in order.
            held: list[dict] | None = [] if choices[0].echo_waits_for_scores else None
            async for tagged in _pinged(prep.bridge.tagged(), wire.ping_every):
                if tagged is None:  # nothing for ping_every seconds (a long prefill): keep the stream open
                    await send(wire.ping())
                    continue
                i, event = tagged
                chunks: list[dict] = []
                if event.kind == "scored" and held is not None:
                    chunks = [c.echo_chunk(event.prompt_logprobs) for c in choices] + held
                    held = None
                elif event.kind == "delta":
                    chunks = choices[i].delta(event)
                elif event.kind == "error":
                    answer.log(request, status_of(event.error), event=event, finish="error")
                    for data in wire.stream_error(event.error):
                        await send(data)
                    failed = True
                    break
                elif event.kind == "finished":
                    chunks = choices[i].finish(event)
                if held is not None and event.kind != "scored":
                    held.extend(chunks)
                    continue
                await write(chunks)
            await write(held or ())  # never scored (it cannot happen to a lane that finished): what it made
            if not failed:
                answer.finished()
                usage = (shape.usage_chunk([c.event for c in choices], answer.reasoning_tokens())
                         if prep.include_usage or wire.always_usage else None)
                for data in wire.closing(usage):
                    await send(data)
                answer.log(request, 200, event=answer.summed())
            await self.stall.finish(request, resp)
        except ClientStalled:
            # the connection is already aborted: nothing more can be sent; the lanes are cancelled
            # by the caller (their bridge never ended)
            answer.log(request, 499, finish="stalled")
        return resp


async def _pinged(events, every: float | None):
    """``events`` (an async iterator), with None in between whenever ``every`` seconds pass
    without one (``every`` None: just ``events``). The pending read is kept across the waits, so
    no event is lost or reordered."""
    if every is None:
        async for item in events:
            yield item
        return
    pending = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(events.__anext__())
            done, _ = await asyncio.wait({pending}, timeout=every)
            if not done:
                yield None
                continue
            task, pending = pending, None
            try:
                yield task.result()
            except StopAsyncIteration:
                return
    finally:
        if pending is not None:
            pending.cancel()


def _admit(limits: KeyLimits, key, prompt_tokens: int, lanes: int) -> list:
    """One ticket per lane (a ticket holds one lane slot); the prompt is charged once, with the
    first, since the lanes share it (it is prefilled once). All or none: a refused one gives the
    others back."""
    tickets = []
    try:
        for i in range(lanes):
            tickets.append(limits.admit(key, prompt_tokens if i == 0 else 0))
    except BaseException:
        for ticket in tickets:
            ticket.end(0, refund_prompt=True)
        raise
    return tickets


def _submit(scheduler, reqs, tickets) -> None:
    """Queue every choice's lane, together (so the others wait for the first's prefill and are
    seeded from it); if one is refused, none runs and the tickets cost a request, not tokens."""
    submitted = []
    try:
        for req in reqs:
            scheduler.submit(req)
            submitted.append(req)
    except BaseException:
        for req in submitted:
            scheduler.cancel(req.id)
        with door_time():
            for ticket in tickets:
                ticket.end(0, refund_prompt=True)  # never queued: it costs a request, not its tokens
        raise


class _Answer:
    """One generation being answered: its prepared request, response shape, its choices, the
    finish callback."""

    def __init__(self, prep: Prepared, shape: Shape, wire: Wire, on_finish=None):
        self.prep = prep
        self.shape = shape
        self.wire = wire  # writes the reply in the request's API
        self.on_finish = on_finish  # on_finish(text, event, prompt_tokens, parsed): for a session's log
        text = TokenText(prep.runtime.engine.token_bytes)
        self.choices = [Choice(i, prep, shape, text) for i in range(len(prep.requests))]

    def reasoning_tokens(self) -> int | None:
        """The reply's reasoning tokens, every choice's (None: the model does not reason)."""
        if self.prep.reasoning is None or self.prep.kind != "chat":
            return None
        return sum(c.reasoning_tokens for c in self.choices)

    def summed(self):
        """The first choice's final event with every choice's completion tokens: the access log's."""
        first = self.choices[0].event
        return attrs.evolve(first, completion_tokens=sum(c.event.completion_tokens for c in self.choices))

    def finished(self) -> None:
        """Every lane finished: a session hears its (one) reply."""
        if self.on_finish is not None:
            first = self.choices[0]
            self.on_finish(first.reply, first.event, self.prep.request.prompt_tokens, first.parsed)

    def log(self, request, status: int, *, event=None, finish: str | None = None) -> None:
        """The access-log line: ``event`` the final one (none for a client that left or stalled).
        A reply that did not finish (``finish`` given, or no final event) is logged with the
        tokens its lanes made before it ended: what the key is charged for it."""
        req = self.prep.request
        if finish is None and event is not None:
            completion = event.completion_tokens
        else:
            completion = sum(c.generated for c in self.choices)
        log_generation(request, status=status, model=self.prep.runtime.name, qos=req.qos,
                       prompt_tokens=len(req.prompt_tokens), arrived=req.arrived, completion_tokens=completion,
                       timings=event.timings if event is not None else {},
                       finish=finish if finish is not None else event.finish_reason)
