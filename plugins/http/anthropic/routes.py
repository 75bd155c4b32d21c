"""Anthropic's Messages routes: ``POST /v1/messages`` and ``POST /v1/messages/count_tokens``.

A message is a chat completion run by the OpenAI routes
(:meth:`~..openai.routes.OpenAIRoutes.generate_chat`: the same preparation, admission, key
limits, QoS, access log and metrics) with :class:`.wire.AnthropicWire` writing its reply, and
``max_tokens`` a ceiling. Every error under ``/v1/messages`` leaves in Anthropic's shape, those
of authentication and routing included. ``?beta=true`` (Claude Code's) and the
``anthropic-version`` / ``anthropic-beta`` headers are accepted: the features they switch on are
decided field by field in :mod:`.protocol`."""

from __future__ import annotations

import asyncio
import time

from aiohttp import web

from ..aliases import served_name
from ..body import read_as
from ..errors import shape_errors_under
from ..keys.auth import check_model
from .mapping import chat_request, trailing_system_allowed
from .protocol import CountTokensRequest, MessagesRequest
from .wire import AnthropicWire, anthropic_error

PREFIX = "/v1/messages"


class AnthropicRoutes:
    def __init__(self, daemon, config, openai):
        self.daemon = daemon
        self.config = config
        self.openai = openai  # runs the generation: the chat path, with this API's wire

    def add_to(self, app: web.Application) -> None:
        app.router.add_post(PREFIX, self.create)
        app.router.add_post(PREFIX + "/count_tokens", self.count_tokens)
        shape_errors_under(app, PREFIX, anthropic_error)

    def _trailing_system(self, request, model: str) -> bool:
        """Where the billing-header block goes for this model (see :mod:`.mapping`)."""
        runtime = self.daemon.get(served_name(request, model))
        return trailing_system_allowed(runtime.engine.info)

    async def create(self, request: web.Request) -> web.StreamResponse:
        arrived = time.monotonic()
        req = await read_as(request, MessagesRequest)
        chat = chat_request(req, self._trailing_system(request, req.model))
        return await self.openai.generate_chat(request, chat, wire=AnthropicWire(req.model, req.max_tokens),
                                               arrived=arrived, limit_is_ceiling=True)

    async def count_tokens(self, request: web.Request) -> web.Response:
        """The prompt's tokens, as ``usage`` would count them (input + cache read + cache creation)."""
        req = await read_as(request, CountTokensRequest)
        chat = chat_request(req, self._trailing_system(request, req.model))
        runtime = self.daemon.get(served_name(request, req.model))
        check_model(request, runtime.name)
        count = await asyncio.get_running_loop().run_in_executor(
            None, self.openai.preparer.chat_prompt_length, chat)
        return web.json_response({"input_tokens": count})
