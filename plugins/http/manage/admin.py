"""Admin routes: load and unload models at runtime.

Unloading drains: new requests for the model get 503 with Retry-After at once, running ones may
finish within the drain timeout and then fail with a clear error; the engine's memory is freed.
Loading brings the model back with its original configuration."""

from __future__ import annotations

import asyncio
import logging

from aiohttp import web

from superfluid.core.errors import InvalidRequest

from ..body import check_fields, read_body

log = logging.getLogger("superfluid.http")

DEFAULT_DRAIN_S = 30.0


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
        body = await _optional_body(request, {"drain_timeout_s"})
        drain = body.get("drain_timeout_s", DEFAULT_DRAIN_S)
        if isinstance(drain, bool) or not isinstance(drain, (int, float)) or not 0 <= drain <= 3600:
            raise InvalidRequest("drain_timeout_s must be a number of seconds between 0 and 3600",
                                 param="drain_timeout_s", code="invalid_value")
        await asyncio.get_running_loop().run_in_executor(None, self.daemon.unload, name, float(drain))
        return web.json_response({"model": name, "state": self.daemon.model_states().get(name, "unloaded")})

    async def load(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        await _optional_body(request, set())
        await asyncio.get_running_loop().run_in_executor(None, self.daemon.reload, name)
        return web.json_response({"model": name, "state": self.daemon.model_states().get(name)})


async def _optional_body(request: web.Request, allowed: set[str]) -> dict:
    if not request.can_read_body:
        return {}
    raw = await request.read()
    if not raw.strip():
        return {}
    return check_fields(await read_body(request), allowed)
