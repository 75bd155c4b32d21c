"""POST /v1/embeddings: each input a lane of its own, through the same scheduler and QoS as chat.

An embedding is a prefill that samples nothing (``Request.embed``): the lane ends with its
prompt's mean-pooled, L2-normalised hidden state in the "finished" event. Going through the
scheduler, not around it, keeps one owner of the engine: embedding lanes wait their turn by
class, count against --max-queue and are cancelled when the client goes away, like any other.

A request's inputs are submitted a window at a time (the engine's lane count), not all at
once: 2048 inputs queued together would fill a class's --max-queue and refuse the request
itself, and would push everyone else of that class behind them."""

from __future__ import annotations

import asyncio
import base64
import time

import numpy as np
from aiohttp import web

from superfluid.core.errors import ContextLengthExceeded, EngineFailure, InvalidRequest, SuperfluidError
from superfluid.core.request import Request

from ..aliases import served_name
from ..lora import request_adapters
from ..access_log import log_generation
from ..body import read_as
from ..bridge import EventBridge
from ..keys.auth import check_model, door_time, note_class, request_key
from ..keys.limits import HEADERS
from ..prepare.qos_class import request_class
from .protocol import EmbeddingRequest


# ---- the body -------------------------------------------------------------------------------


def tokens_of(runtime, inputs: list[str | list[int]]) -> list[list[int]]:
    """Each input's tokens: a string tokenized with the model's BOS and no special-token parsing
    (an embedded text is data, not markup); token ids checked against the vocabulary."""
    engine, n_vocab = runtime.engine, runtime.engine.info.n_vocab
    out = []
    for i, item in enumerate(inputs):
        if isinstance(item, str):
            tokens = engine.tokenize(item, add_special=True, parse_special=False)
        else:
            bad = [t for t in item if not 0 <= t < n_vocab]
            if bad:
                raise InvalidRequest(f"input[{i}]: token id {bad[0]} is outside the vocabulary "
                                     f"(0..{n_vocab - 1})", param="input", code="invalid_value")
            tokens = list(item)
        out.append(tokens)
    return out


def check_context(prompts: list[list[int]], ctx: int) -> None:
    """Every input must fit the context, as the scheduler's submit requires: checked for all of
    them before the first is queued, so a bad input late in a batch costs nothing computed."""
    for i, tokens in enumerate(prompts):
        if len(tokens) >= ctx:
            raise ContextLengthExceeded(f"input[{i}]: this model's maximum context length is {ctx} tokens, "
                                        f"but the input has {len(tokens)} tokens.", param="input")


def check_dimensions(req, width: int, model: str) -> None:
    """``dimensions`` may only restate the model's width: its embeddings are not truncatable
    (no Matryoshka training assumed), so any other value is refused rather than faked."""
    if req.dimensions is not None and req.dimensions != width:
        raise InvalidRequest(f"model {model!r} gives embeddings of {width} dimensions; dimensions must "
                             f"be {width} or absent, got {req.dimensions}", param="dimensions", code="invalid_value")


def encode(vector: tuple[float, ...], fmt: str):
    """A vector as the response carries it: floats, or base64 of little-endian float32 (what the
    openai client decodes)."""
    if fmt == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
    return [float(x) for x in vector]


# ---- the route ------------------------------------------------------------------------------


class EmbeddingRoutes:
    """``key_limits``: the front end's :class:`~..keys.limits.KeyLimits` (shared with the
    generation routes, so a key's lanes and budgets count embeddings too)."""

    def __init__(self, daemon, config, key_limits, catchup=None):
        self.daemon = daemon
        self.config = config
        self.key_limits = key_limits
        self.catchup = catchup

    def add_to(self, app: web.Application) -> None:
        app.router.add_post("/v1/embeddings", self.embeddings)

    async def embeddings(self, request: web.Request) -> web.Response:
        arrived = time.monotonic()
        return web.json_response(await self.embed(request, await read_as(request, EmbeddingRequest), arrived))

    async def embed(self, request: web.Request, req: EmbeddingRequest, arrived: float) -> dict:
        """The OpenAI embeddings body for a typed request: what ``/v1/embeddings`` answers, and
        what another API's embedding route (Ollama's) translates."""
        served = served_name(request, req.model)
        runtime = self.daemon.get(served)
        check_model(request, runtime.name)
        adapters = request_adapters(runtime, served, None)  # MODEL:ADAPTER embeds under that LoRA adapter
        runtime.loop.check_serves(embed=True)  # before tokenizing inputs it would not embed
        fmt = req.encoding_format
        check_dimensions(req, runtime.engine.info.n_embd, runtime.name)
        prompts = tokens_of(runtime, req.inputs)
        check_context(prompts, runtime.loop.settings.context_length)
        vectors, counted = await self.pooled(request, runtime, prompts, req.superfluid, arrived, adapters=adapters)
        data = [{"object": "embedding", "index": i, "embedding": encode(v, fmt)} for i, v in enumerate(vectors)]
        return {"object": "list", "data": data, "model": runtime.name,
                "usage": {"prompt_tokens": counted, "total_tokens": counted}}

    async def pooled(self, request: web.Request, runtime, prompts: list[list[int]], extension, arrived: float, *,
                     rank: bool = False, what: str = "input", adapters: tuple = ()) -> tuple[list[tuple], int]:
        """Run checked ``prompts`` as embedding lanes under the request's QoS class (``extension``:
        its ``superfluid`` field), key, budgets and lane limits, logged as one request: (each
        prompt's vector in order, the prompt tokens counted). ``rank``: a reranker's lanes
        (Request.rank), whose vectors are its head's scores; ``what`` names a prompt in errors
        (``input[3]``); ``adapters``: the LoRA set they run under. What /v1/embeddings and
        /v1/rerank share."""
        cls = note_class(request, request_class(request, self.config, extension))
        key = request_key(request)
        if key is not None:
            request[HEADERS] = (self.key_limits, key)
        n_prompt = sum(len(p) for p in prompts)
        with door_time():
            ticket = self.key_limits.admit(key, n_prompt)
        status, finish = 500, "error"
        batch = _Batch(runtime, prompts, cls, arrived, self.catchup, rank=rank, what=what, adapters=adapters)
        try:
            vectors, counted = await batch.run()
            status, finish = 200, "stop"
        except SuperfluidError as exc:
            status = exc.status
            raise
        except (ConnectionResetError, asyncio.CancelledError):
            status, finish = 499, "disconnected"
            raise
        finally:
            with door_time():  # refused before any lane was queued: it costs a request, not its tokens
                ticket.end(0, refund_prompt=batch.submitted == 0)
            log_generation(request, status=status, model=runtime.name, qos=cls, prompt_tokens=n_prompt,
                           completion_tokens=0, timings={}, finish=finish, arrived=arrived)
        return vectors, counted


class _Batch:
    """One request's inputs run as embedding lanes, at most a window of them at a time; the
    first failure (or the client leaving) cancels the rest."""

    def __init__(self, runtime, prompts: list[list[int]], qos: str, arrived: float, catchup=None, *,
                 rank: bool = False, what: str = "input", adapters: tuple = ()):
        self.runtime, self.prompts, self.qos, self.arrived = runtime, prompts, qos, arrived
        self.adapters = adapters
        self.catchup = catchup
        self.rank, self.what = rank, what  # reranker lanes; how errors name a prompt
        self.window = asyncio.Semaphore(max(1, runtime.engine.capabilities.max_lanes))
        self.submitted = 0  # lanes the scheduler took

    async def run(self) -> tuple[list[tuple], int]:
        """(the vectors in input order, the prompt tokens counted)."""
        tasks = [asyncio.ensure_future(self._one(i, p)) for i, p in enumerate(self.prompts)]
        try:
            results = await asyncio.gather(*tasks)
        except BaseException:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)  # each cancels its own lane
            raise
        return [v for v, _ in results], sum(n for _, n in results)

    async def _one(self, index: int, tokens: list[int]) -> tuple[tuple, int]:
        async with self.window:
            scheduler = self.runtime.loop
            bridge = EventBridge(asyncio.get_running_loop(), hold_deltas=True, catchup=self.catchup)
            # a rank lane reads only its last position: it may start from a cached prefix (the query's)
            req = Request(prompt_tokens=tokens, max_tokens=1, sink=bridge, qos=self.qos, embed=True, rank=self.rank,
                          reuse_prefix=self.rank, arrived=self.arrived, meta={"embedding": True},
                          adapters=self.adapters)
            try:
                scheduler.submit(req)  # a prompt longer than the context is refused here
            except ContextLengthExceeded as exc:
                raise ContextLengthExceeded(f"{self.what}[{index}]: {exc.message}", param=self.what) from None
            self.submitted += 1
            try:
                async for event in bridge.events():
                    if event.kind == "error":
                        if isinstance(event.error, SuperfluidError):
                            raise event.error
                        raise EngineFailure(f"embedding failed: {event.error}")
                    if event.kind == "finished":
                        if not event.embedding:
                            raise EngineFailure(f"{self.what}[{index}] ended ({event.finish_reason}) without "
                                                f"{'a score' if self.rank else 'an embedding'}")
                        return tuple(event.embedding), event.prompt_tokens or len(tokens)
            finally:
                if not bridge.done:
                    scheduler.cancel(req.id)
        raise AssertionError("event stream ended without a final event")
