"""POST /apply-template, in llama-server's shape: a chat completion's body in, ``{"prompt": TEXT}``
out, the text the model would be sent for it.

It is the chat route's own preparation up to the rendered prompt (:meth:`Preparer.chat_text`):
the same typed body and its 400s, the model's chat setup (``chat-template-file``, a named
template or its own), tools described or rendered, a forced call's pre-fill. So a client (or a
test) sees what a chat completion renders, not what a separate renderer might. No lane runs, so
no scheduler or key limiter is involved; a key's model allow-list applies as on every route."""

from __future__ import annotations

from aiohttp import web

from ..body import read_as
from ..keys.auth import check_model
from .chat_protocol import ChatCompletionRequest


class ApplyTemplateRoutes:
    def __init__(self, openai):
        self.openai = openai  # the chat route's preparer and image loader

    def add_to(self, app: web.Application) -> None:
        app.router.add_post("/apply-template", self.apply_template)

    async def apply_template(self, request: web.Request) -> web.Response:
        req = await read_as(request, ChatCompletionRequest)
        preparer = self.openai.preparer
        check_model(request, preparer.chat_runtime(req).name)
        await self.openai.load_images(req)  # an image's markers are laid out as the chat route does
        return web.json_response({"prompt": preparer.chat_text(req)})
