"""This front end's routes."""

from __future__ import annotations

from aiohttp import web


class ResponsesRoutes:
    """``openai``: the front end's OpenAIRoutes, whose preparer, key limits and catch-up this
    front end shares (one preparation path, one limiter)."""

    def __init__(self, daemon, config, openai):
        self.daemon = daemon
        self.config = config
        self.openai = openai

    def add_to(self, app: web.Application) -> None:
        pass
