"""The aiohttp front end: builds the application and runs it on the configured address."""

from __future__ import annotations

import asyncio
import logging
import signal

from aiohttp import web

from superfluid.core.config import CORE_OPTIONS
from superfluid.core.tls import server_context

from .aliases import ALIASES, Aliases
from .anthropic.routes import AnthropicRoutes
from .catchup import LoopCatchup
from .cors import Cors
from .errors import json_errors
from .events.hub import EventHub
from .events.key_tally import TeeMetrics
from .events.routes import EventsRoutes
from .info.route_metrics import count_by_route
from .info.routes import InfoRoutes
from .input_limits import LIMITS, Limits, guard
from .keys import auth
from .keys.policy import PolicyFile
from .manage.adapters import AdapterRoutes
from .manage.admin import AdminRoutes
from .manage.sessions import SessionRoutes
from .openai.embeddings import EmbeddingRoutes
from .openai.routes import OpenAIRoutes
from .ollama.routes import OllamaRoutes
from .openai.apply_template import ApplyTemplateRoutes
from .openai.tokenize import TokenizeRoutes
from .options import OPTIONS
from .rerank.routes import RerankRoutes
from .responses.routes import ResponsesRoutes

log = logging.getLogger("superfluid.http")


def build_app(daemon, config, catchup: LoopCatchup | None = None,
              keys: PolicyFile | None = None, events: EventHub | None = None) -> web.Application:
    """The application; ``catchup``: the event loop's catch-up its bridges count wake-ups on;
    ``keys``: the key policy (None: no keys, /admin for loopback clients only); ``events``: the
    hub behind /events, fed by the scheduler hooks it is registered for (None: a hub of its own,
    which hears no ticks unless registered)."""
    # json_errors outside authentication, so its 401s and 403s leave as JSON bodies in the API's shape
    limits = Limits.from_config(config)  # --max-body-mb and the other input limits
    # count_by_route outside them all: /metrics counts the status that left, whoever made it
    # CORS preflights are answered before authentication: a browser sends them without the key
    cors = Cors(OPTIONS.of(config).cors_origins)
    app = web.Application(middlewares=[count_by_route, json_errors, *([cors.middleware()] if cors else []),
                                       auth.middleware(keys, config)],
                          client_max_size=limits.max_body_bytes)
    app[LIMITS] = limits
    app.on_response_prepare.append(auth.qos_header(config))
    if cors:
        app.on_response_prepare.append(cors.on_prepare())  # streams (SSE) carry the CORS headers too
    served = list(daemon.models) or [m.name for m in getattr(config, "models", ())]
    aliases = app[ALIASES] = Aliases(OPTIONS.of(config).model_alias, served)
    openai = OpenAIRoutes(daemon, config, catchup, aliases)
    openai.add_to(app)
    SessionRoutes(daemon, config, openai).add_to(app)
    ResponsesRoutes(daemon, config, openai).add_to(app)  # /v1/responses: OpenAI's Responses API (Codex)
    AnthropicRoutes(daemon, config, openai).add_to(app)  # /v1/messages: Anthropic's Messages API (Claude Code)
    # the generation routes' key limiter: a key's lanes and budgets count its embeddings too
    embeddings = EmbeddingRoutes(daemon, config, openai.key_limits, catchup)
    embeddings.add_to(app)
    RerankRoutes(daemon, embeddings).add_to(app)  # /v1/rerank, /v1/score: a reranker's pairs as embedding lanes
    OllamaRoutes(daemon, config, openai, embeddings).add_to(app)  # /api/…: Ollama's API (Open WebUI, editors)
    TokenizeRoutes(daemon).add_to(app)
    ApplyTemplateRoutes(openai).add_to(app)  # /apply-template: the prompt a chat body renders to
    AdminRoutes(daemon).add_to(app)
    AdapterRoutes(daemon).add_to(app)  # LoRA adapters: /admin/models/{name}/adapters, /lora-adapters
    InfoRoutes(daemon, aliases).add_to(app)
    events = events if events is not None else EventHub(daemon, keys)
    # the key limiter reports each key's requests, tokens and rejections to /events too
    openai.key_limits.metrics = TeeMetrics(openai.key_limits.metrics, events.keys)
    EventsRoutes(daemon, events).add_to(app)
    return app


class HttpFrontend:
    def __init__(self, daemon, config):
        self.daemon = daemon
        self.config = config
        self.runner: web.AppRunner | None = None
        self.catchup: LoopCatchup | None = None
        self.keys: PolicyFile | None = None
        self.events: EventHub | None = None
        self._sighup = False

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self.catchup = LoopCatchup(loop)
        key_policy = OPTIONS.of(self.config).key_policy
        if key_policy:
            self.keys = PolicyFile(key_policy)  # a bad file: ConfigError, exit 2
            # SIGHUP re-reads it; a request in flight keeps its key, a bad file keeps the old policy
            loop.add_signal_handler(signal.SIGHUP, self.keys.reload)
            self._sighup = True
            log.info("key policy %s: %d keys", self.keys.path, len(self.keys.current.keys))
        self.events = EventHub(self.daemon, self.keys)
        app = build_app(self.daemon, self.config, self.catchup, self.keys, self.events)
        # handler_cancellation: a client that disconnects cancels its handler, which cancels its lane.
        # keep-alive, header size and head deadline: the connections are GuardedHandlers (input_limits.py)
        self.runner = web.AppRunner(app, access_log=None, handler_cancellation=True,
                                    **app[LIMITS].server_kwargs())
        await self.runner.setup()
        guard(self.runner)
        core = CORE_OPTIONS.of(self.config)
        host, port = core.host, core.port
        tls = server_context(core.ssl_certfile, core.ssl_keyfile)  # checked before the models loaded too
        site = web.TCPSite(self.runner, host, port, backlog=1024, ssl_context=tls)
        await site.start()
        # the models' threads reach the catch-up through their tick hook (see catchup.py)
        self.daemon.pm.register(self.catchup, name=f"superfluid.http.catchup-{id(self)}")
        # and the /events hub its ticks (a tuple appended per tick) and finished lanes
        self.daemon.pm.register(self.events, name=f"superfluid.http.events-{id(self)}")
        port = self.runner.addresses[0][1] if self.runner.addresses else port
        scheme = "https" if tls is not None else "http"
        log.info("serving %s on %s://%s:%s", ", ".join(self.daemon.models), scheme, host, port)
        print(f"superfluid: serving {', '.join(self.daemon.models)} on {scheme}://{host}:{port}", flush=True)

    async def stop(self) -> None:
        if self._sighup:
            asyncio.get_running_loop().remove_signal_handler(signal.SIGHUP)
            self._sighup = False
        if self.catchup is not None:
            self.catchup.detach()
            if self.daemon.pm.is_registered(self.catchup):
                self.daemon.pm.unregister(self.catchup)
        if self.events is not None and self.daemon.pm.is_registered(self.events):
            self.daemon.pm.unregister(self.events)
        if self.runner is not None:
            await self.runner.cleanup()
