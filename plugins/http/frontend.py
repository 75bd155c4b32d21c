"""The aiohttp front end: builds the application and runs it on the configured address."""

from __future__ import annotations

import asyncio
import logging

from aiohttp import web

from .admin_routes import AdminRoutes
from .catchup import LoopCatchup
from .errors import json_errors
from .info_routes import InfoRoutes
from .openai_routes import OpenAIRoutes
from .session_routes import SessionRoutes

log = logging.getLogger("superfluid.http")

MAX_BODY_BYTES = 64 << 20


def build_app(daemon, config, catchup: LoopCatchup | None = None) -> web.Application:
    """The application; ``catchup``: the event loop's catch-up its bridges count wake-ups on."""
    app = web.Application(middlewares=[json_errors], client_max_size=MAX_BODY_BYTES)
    openai = OpenAIRoutes(daemon, config, catchup)
    openai.add_to(app)
    SessionRoutes(daemon, config, openai).add_to(app)
    AdminRoutes(daemon).add_to(app)
    InfoRoutes(daemon).add_to(app)
    return app


class HttpFrontend:
    def __init__(self, daemon, config):
        self.daemon = daemon
        self.config = config
        self.runner: web.AppRunner | None = None
        self.catchup: LoopCatchup | None = None

    async def start(self) -> None:
        self.catchup = LoopCatchup(asyncio.get_running_loop())
        app = build_app(self.daemon, self.config, self.catchup)
        # handler_cancellation: a client that disconnects cancels its handler, which cancels its lane.
        self.runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
        await self.runner.setup()
        host, port = self.config["host"], self.config["port"]
        site = web.TCPSite(self.runner, host, port, backlog=1024)
        await site.start()
        # the scheduler threads reach the catch-up through their tick hook (see catchup.py)
        self.daemon.pm.register(self.catchup, name=f"superfluid.http.catchup-{id(self)}")
        port = self.runner.addresses[0][1] if self.runner.addresses else port
        log.info("serving %s on http://%s:%s", ", ".join(self.daemon.models), host, port)
        print(f"superfluid: serving {', '.join(self.daemon.models)} on http://{host}:{port}", flush=True)

    async def stop(self) -> None:
        if self.catchup is not None:
            self.catchup.detach()
            if self.daemon.pm.is_registered(self.catchup):
                self.daemon.pm.unregister(self.catchup)
        if self.runner is not None:
            await self.runner.cleanup()
