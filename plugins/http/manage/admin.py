"""Admin routes: load and unload models at runtime.

Unloading drains: new requests for the model get 503 with Retry-After at once, running ones may
finish within the drain timeout and then fail with a clear error; the engine's memory is freed.
Loading brings the model back with its original configuration."""

from __future__ import annotations

import asyncio
import logging

from aiohttp import web

from ..body import read_optional
from .protocol import LoadRequest, UnloadRequest

log = logging.getLogger("superfluid.http")


class AdminRoutes:
    def __init__(self, daemon):
        self.daemon = daemon

    def add_to(self, app: web.Application) -> None:
        app.router.add_get("/admin/models", self.states)
        app.router.add_post("/admin/models/{name}/unload", self.unload)
        app.router.add_post("/admin/models/{name}/load", self.load)

    async def states(self, request: web.Request) -> web.Response:
        return web.json_response({"models": self.daemon.model_states()})

    async def unload(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        req = await read_optional(request, UnloadRequest)
        await asyncio.get_running_loop().run_in_executor(None, self.daemon.unload, name, req.drain_timeout_s)
        return web.json_response({"model": name, "state": self.daemon.model_states().get(name, "unloaded")})

    async def load(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        await read_optional(request, LoadRequest)
        await asyncio.get_running_loop().run_in_executor(None, self.daemon.reload, name)
        return web.json_response({"model": name, "state": self.daemon.model_states().get(name)})
