"""GET /v1/models, /v1/models/{id}, /health, /slots, /metrics and /openapi.json."""

from __future__ import annotations

import time

from aiohttp import web

from superfluid.core.config import CORE_OPTIONS
from superfluid.core.errors import ModelNotFound
from superfluid.core.formats.setup import chat_of

from ..aliases import Aliases
from .metrics import METRICS
from .openapi import document


class InfoRoutes:
    def __init__(self, daemon, aliases: Aliases | None = None):
        self.daemon = daemon
        self.aliases = aliases if aliases is not None else Aliases([], [])  # listed beside their models
        self.started = int(time.time())
        self._document: dict | None = None  # built on first request
        # the model-server gauges, read at scrape time; cells count in blocks of KV events' size
        config = getattr(daemon, "config", None)
        METRICS.serve_models(lambda: daemon.models,
                             CORE_OPTIONS.of(config).kv_events_block_size if config else None)

    def add_to(self, app: web.Application) -> None:
        app.router.add_get("/v1/models", self.models)
        # {id:.+}: a model name may hold slashes ("org/model"), as OpenAI's own route allows
        app.router.add_get("/v1/models/{id:.+}", self.model)
        app.router.add_get("/health", self.health)
        app.router.add_get("/slots", self.slots)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/openapi.json", self.openapi)

    def _entry(self, name: str, rt, alias=None) -> dict:
        """One model (or an alias of one) as /v1/models lists it and /v1/models/{id} answers it.

        The context window is given under the names clients read: ``context_length`` (OpenRouter,
        LM Studio), ``max_model_len`` (vLLM), ``context_window``, and Anthropic's model object
        fields (``type``, ``display_name``, ``created_at``, ``max_input_tokens``) so an
        Anthropic client listing models finds them in the same list. ``meta`` holds superfluid's
        own: engine, path, lanes, and the chat setup (which template, from where; which formats
        read its replies) that :meth:`~superfluid.core.formats.setup.ChatSetup.describe` gives."""
        caps = rt.engine.capabilities
        ctx = caps.context_length
        meta = {"engine": rt.config.engine, "path": rt.engine.info.path, "context_length": ctx,
                "max_batch": caps.max_lanes, **chat_of(rt).describe()}  # its chat template's source, its formats
        if alias is not None:
            meta.update(alias_of=alias.model, qos=alias.qos)
        created = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.started))
        return {"id": name, "object": "model", "created": self.started, "owned_by": "superfluid",
                "context_length": ctx, "context_window": ctx, "max_model_len": ctx,
                "type": "model", "display_name": name, "created_at": created,
                "max_input_tokens": ctx, "max_tokens": ctx, "meta": meta}

    def _adapter_entries(self, name: str, rt) -> list[dict]:
        """A model's LoRA adapters, each a model ``NAME:ADAPTER`` whose ``parent`` is the model
        and ``root`` the adapter's file, as vLLM lists them."""
        out = []
        for adapter in rt.loop.adapters.served():
            entry = self._entry(f"{name}:{adapter.name}", rt)
            entry.update(parent=name, root=adapter.path)
            entry["meta"].update(lora={"id": adapter.id, "name": adapter.name, "scale": adapter.scale})
            out.append(entry)
        return out

    def _entries(self) -> list[dict]:
        models = dict(self.daemon.models)
        data = [self._entry(name, rt) for name, rt in models.items()]
        data += [e for name, rt in models.items() for e in self._adapter_entries(name, rt)]
        data += [self._entry(a.name, models[a.model], a) for a in self.aliases if a.model in models]
        return data

    async def models(self, request: web.Request) -> web.Response:
        data = self._entries()
        # Anthropic's list envelope beside OpenAI's: an Anthropic client pages with these
        return web.json_response({"object": "list", "data": data, "has_more": False,
                                  "first_id": data[0]["id"] if data else None,
                                  "last_id": data[-1]["id"] if data else None})

    async def model(self, request: web.Request) -> web.Response:
        """One served model or alias; one not served is what a request naming it gets: 404 if
        unknown, 503 with Retry-After if unloaded or loading."""
        name = request.match_info["id"]
        for entry in self._entries():
            if entry["id"] == name:
                return web.json_response(entry)
        rt = self.daemon.models.get(name)
        if rt is not None:
            return web.json_response(self._entry(name, rt))
        self.daemon.get(name)  # raises the 404 (or 503) naming the served models
        raise ModelNotFound(f"The model {name!r} does not exist", param="model")

    async def health(self, request: web.Request) -> web.Response:
        models = {}
        healthy = bool(self.daemon.models)
        for name, rt in list(self.daemon.models.items()):
            desc = rt.engine.describe()
            models[name] = {**desc, "lanes_busy": len(rt.loop.lanes), "queued": len(rt.loop.queue)}
            if rt.state != "ready":
                models[name]["state"] = rt.state
            healthy = healthy and desc.get("state", "ready") == "ready"
        for name, state in self.daemon.model_states().items():
            if state in ("unloaded", "loading"):  # taken out on purpose: reported, not unhealthy
                models[name] = {"state": state}
        body = {"status": "ok" if healthy else "degraded", "models": models}
        return web.json_response(body, status=200 if healthy else 503)

    async def slots(self, request: web.Request) -> web.Response:
        wanted = request.query.get("model")
        snaps = {name: rt.loop.snapshot() for name, rt in list(self.daemon.models.items())
                 if wanted in (None, name)}
        if wanted is not None and not snaps:
            self.daemon.get(wanted)  # raises the 404 with the list of models (503: unloaded)
            raise ModelNotFound(f"The model {wanted!r} does not exist; served models: "
                                f"{', '.join(self.daemon.models) or 'none'}", param="model")  # e.g. ?model=
        return web.json_response({"models": snaps})

    async def openapi(self, request: web.Request) -> web.Response:
        if self._document is None:
            self._document = document()
        return web.json_response(self._document)

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=METRICS.render(), content_type="text/plain", charset="utf-8",
                            headers={"X-Content-Type-Options": "nosniff"})
