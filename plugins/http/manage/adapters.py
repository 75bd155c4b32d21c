"""LoRA adapter routes: the admin API that loads and unloads a model's adapters at runtime, and
llama-server's ``/lora-adapters`` (list them; set the global scales).

A load goes to the engine with the model's next tick (before that tick's lanes) and its answer
is this route's: 200 once loaded, 422 with the engine's reason when the file is no adapter of
this model (the adapter is then unknown, as before). An unload stops new requests for the
adapter at once (404 from then on), lets the lanes running or queued under it finish, then
unloads it: 200 when that happened within ``drain_timeout_s``, else 202 (it is unloaded when
they end)."""

from __future__ import annotations

import asyncio
import logging
from typing import Annotated

from aiohttp import web
from pydantic import Field

from superfluid.core.errors import ConfigError, EngineFailure, InvalidRequest, SuperfluidError

from ..body import read_as, read_body, read_optional
from ..keys.auth import Forbidden, request_key
from ..lora import LoraRef
from ..typed import RequestBody, parse

log = logging.getLogger("superfluid.http")


class AdapterLoadRequest(RequestBody):
    """``POST /admin/models/{name}/adapters``."""

    name: Annotated[str, Field(min_length=1, max_length=128)] = Field(description="the adapter's name: "
                                                                                "requests select it as MODEL:NAME")
    path: Annotated[str, Field(min_length=1)] = Field(description="the adapter file (a GGUF LoRA) on the server")
    scale: Annotated[float, Field(ge=-100.0, le=100.0, allow_inf_nan=False)] | None = Field(
        1.0, description="the scale a request selecting it without one gets")


class AdapterUnloadRequest(RequestBody):
    """``DELETE /admin/models/{name}/adapters/{adapter}`` (the body is optional)."""

    drain_timeout_s: Annotated[float, Field(ge=0, le=3600, allow_inf_nan=False)] | None = Field(
        30.0, description="seconds to wait for its lanes to finish before answering 202")


class AdapterLoadFailed(SuperfluidError):
    status = 422
    type = "invalid_request_error"
    code = "adapter_load_failed"


class AdapterRoutes:
    def __init__(self, daemon):
        self.daemon = daemon

    def add_to(self, app: web.Application) -> None:
        app.router.add_get("/admin/models/{name}/adapters", self.listing)
        app.router.add_post("/admin/models/{name}/adapters", self.load)
        app.router.add_delete("/admin/models/{name}/adapters/{adapter}", self.unload)
        app.router.add_get("/lora-adapters", self.lora_adapters)
        app.router.add_post("/lora-adapters", self.set_scales)

    def _runtime(self, name: str | None):
        return self.daemon.get(name)

    # ---- admin ----------------------------------------------------------------------------

    async def listing(self, request: web.Request) -> web.Response:
        rt = self._runtime(request.match_info["name"])
        return web.json_response({"model": rt.name, "adapters": [a.view(rt.name) for a in rt.loop.adapters.listing()]})

    async def load(self, request: web.Request) -> web.Response:
        rt = self._runtime(request.match_info["name"])
        req = await read_as(request, AdapterLoadRequest)
        scale = 1.0 if req.scale is None else req.scale
        try:
            adapter = await asyncio.get_running_loop().run_in_executor(
                None, rt.loop.load_adapter, req.name, req.path, scale)
        except ConfigError as exc:  # a bad name, a file that does not exist
            raise InvalidRequest(str(exc), param="path" if "exist" in str(exc) else "name",
                                 code="invalid_adapter") from None
        except EngineFailure as exc:
            if exc.code == "adapter_load_failed":
                raise AdapterLoadFailed(exc.message, param="path") from None
            raise
        log.info("admin: model %s: LoRA adapter %s loaded (id %d)", rt.name, adapter.name, adapter.id)
        return web.json_response(adapter.view(rt.name))

    async def unload(self, request: web.Request) -> web.Response:
        rt = self._runtime(request.match_info["name"])
        name = request.match_info["adapter"]
        req = await read_optional(request, AdapterUnloadRequest)
        timeout = 30.0 if req.drain_timeout_s is None else req.drain_timeout_s
        done = await asyncio.get_running_loop().run_in_executor(None, rt.loop.unload_adapter, name, timeout)
        body = {"model": rt.name, "adapter": name, "state": "unloaded" if done else "unloading"}
        return web.json_response(body, status=200 if done else 202)

    # ---- llama-server's /lora-adapters -----------------------------------------------------

    async def lora_adapters(self, request: web.Request) -> web.Response:
        """llama-server's list: id, path, scale (the global scale), with the name and the model
        name that selects it. ``?model=`` picks the model (default: the first)."""
        rt = self._runtime(request.query.get("model"))
        return web.json_response([_listed(a, rt.name) for a in rt.loop.adapters.served()])

    async def set_scales(self, request: web.Request) -> web.Response:
        """llama-server's ``[{"id": 0, "scale": 0.2}, ...]``: the global scales, applied to
        requests naming the base model without a ``lora`` field; unlisted adapters get 0. A key
        policy's non-admin keys may not change them."""
        key = request_key(request)
        if key is not None and not key.admin:
            raise Forbidden(f"key {key.name!r} may not set global LoRA scales", code="admin_required")
        rt = self._runtime(request.query.get("model"))
        body = await read_body(request)
        if not isinstance(body, list):
            raise InvalidRequest("expected a JSON list of {id, scale}", code="invalid_body")
        refs = [parse(LoraRef, item) for item in body]
        table = rt.loop.adapters
        scales = {}
        for i, ref in enumerate(refs):
            found = table.by_id(ref.id) if isinstance(ref.id, int) else table.get(str(ref.id))
            if found is None:
                raise InvalidRequest(f"[{i}]: model {rt.name!r} has no LoRA adapter {ref.id!r}", param="id",
                                     code="adapter_not_found")
            scales[found.id] = found.scale if ref.scale is None else ref.scale
        table.set_global(scales)
        log.info("model %s: global LoRA scales %s", rt.name, table.default_set() or "none (the base model)")
        return web.json_response([_listed(a, rt.name) for a in table.served()])


def _listed(adapter, model: str) -> dict:
    return {"id": adapter.id, "path": adapter.path, "scale": adapter.global_scale, "name": adapter.name,
            "model": f"{model}:{adapter.name}"}
