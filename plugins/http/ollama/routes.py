"""Ollama's native API, as the ``ollama`` library, Open WebUI, LangChain's ``ChatOllama`` and
editor plugins speak it.

Generation (``/api/chat``, ``/api/generate``) is a chat or completion run by the OpenAI routes
(:meth:`~..openai.routes.OpenAIRoutes.generate_chat`: the same preparation, admission, key
policy, QoS classes and aliases, limits, access log and metrics), streamed as NDJSON by default,
with :class:`.wire.OllamaWire` writing it. Embeddings go through the embeddings route's own run.
The model routes (``/api/tags``, ``/api/show``, ``/api/ps``, ``/api/version``, ``GET /``) answer
from what the daemon serves. Every error under ``/api`` leaves in Ollama's shape,
``{"error": "…"}``.

Unlike Ollama, every served model answers at once on its own lanes: 8 clients at once get 8
lanes (``--max-batch``), where Ollama serves one request at a time by default
(``OLLAMA_NUM_PARALLEL``), and a model alias with a class (``--model-alias
title-model=smollm2@background``) keeps a client's side requests from slowing its first turns.

**Loading and ``keep_alive``.** Models are loaded when the server starts and stay loaded; the
lifecycle is the server's (``/admin/models/NAME/unload`` and ``load``). ``keep_alive`` is
accepted and changes nothing. A request with no prompt (Ollama's way to load a model) answers
``done_reason: "load"`` at once, and with ``keep_alive: 0`` (Ollama's way to unload one)
``done_reason: "unload"`` without unloading anything."""

from __future__ import annotations

import asyncio
import hashlib
import os
import time
from datetime import datetime, timezone

from aiohttp import web

from superfluid.core.chat import template_caps
from superfluid.core.errors import InvalidRequest, ModelNotFound
from superfluid.core.formats.setup import chat_of

from ..aliases import ALIASES, served_name
from ..body import read_as
from ..errors import shape_errors_under
from ..keys.auth import check_model
from ..openai.protocol import EmbeddingRequest
from ..prepare.qos_class import request_class
from ..typed import parse
from .mapping import chat_request, generate_request
from .protocol import (OllamaChatRequest, OllamaEmbeddingsRequest, OllamaEmbedRequest, OllamaGenerateRequest,
                       OllamaShowRequest)
from .wire import OllamaWire, now_iso, ollama_error

PREFIX = "/api"
#: the Ollama version reported to clients that check one before using a feature (tools,
#: thinking, structured outputs): the API this front end follows
OLLAMA_VERSION = "0.12.0"


class OllamaRoutes:
    def __init__(self, daemon, config, openai, embeddings):
        self.daemon = daemon
        self.config = config
        self.openai = openai  # runs generations: the chat path, with this API's wire
        self.embeddings = embeddings  # runs embeddings: /v1/embeddings' path

    def add_to(self, app: web.Application) -> None:
        app.router.add_get("/", self.root)  # HEAD / too: clients probe both
        app.router.add_post(PREFIX + "/chat", self.chat)
        app.router.add_post(PREFIX + "/generate", self.generate)
        app.router.add_post(PREFIX + "/embed", self.embed)
        app.router.add_post(PREFIX + "/embeddings", self.embeddings_v1)
        app.router.add_get(PREFIX + "/tags", self.tags)
        app.router.add_post(PREFIX + "/show", self.show)
        app.router.add_get(PREFIX + "/ps", self.ps)
        app.router.add_get(PREFIX + "/version", self.version)
        shape_errors_under(app, PREFIX, ollama_error)

    # ---- names ------------------------------------------------------------------------------

    def _asked(self, request, name: str) -> str:
        """The model or alias a client's name means: ``NAME:latest`` is ``NAME`` (Ollama's
        clients add the tag). An alias stays an alias, so its class applies."""
        if served_name(request, name) not in self.daemon.models and name.endswith(":latest"):
            return name[:-len(":latest")]
        return name

    def _served(self, request, name: str) -> str:
        """The served model a client's name means."""
        return served_name(request, self._asked(request, name))

    def _runtime(self, request, name: str):
        runtime = self.daemon.get(self._served(request, name))
        check_model(request, runtime.name)
        return runtime

    # ---- generation -----------------------------------------------------------------------------

    async def chat(self, request: web.Request) -> web.StreamResponse:
        arrived = time.monotonic()
        req = await read_as(request, OllamaChatRequest)
        stream = req.stream is not False
        if not req.messages:
            return self._loaded(request, req, chat=True)
        model = self._asked(request, req.model)
        chat = chat_request(req, model, stream)
        await self._check_num_ctx(request, req, chat, model)
        return await self.openai.generate_chat(request, chat, wire=OllamaWire(req.model, True, arrived),
                                               arrived=arrived, limit_is_ceiling=True)

    async def generate(self, request: web.Request) -> web.StreamResponse:
        arrived = time.monotonic()
        req = await read_as(request, OllamaGenerateRequest)
        stream = req.stream is not False
        if not req.prompt and not req.images and req.suffix is None:
            return self._loaded(request, req, chat=False)
        model = self._asked(request, req.model)
        gen = generate_request(req, model, stream)
        await self._check_num_ctx(request, req, gen, model)
        return await self.openai.generate_chat(request, gen, wire=OllamaWire(req.model, False, arrived),
                                               arrived=arrived, limit_is_ceiling=True)

    def _loaded(self, request, req, chat: bool) -> web.Response:
        """A request with nothing to generate: Ollama's load (or, with keep_alive 0, unload)."""
        self._runtime(request, req.model)  # a 404 for a model not served
        request_class(request, self.config, None)  # a bad x-superfluid-qos is a 400 here too
        reason = "unload" if req.keep_alive in (0, "0", "0s", "0m") else "load"
        body = {"model": req.model, "created_at": now_iso(), "done": True, "done_reason": reason}
        body.update({"message": {"role": "assistant", "content": ""}} if chat else {"response": ""})
        return web.json_response(body)

    async def _check_num_ctx(self, request, req, typed, model: str) -> None:
        """``options.num_ctx`` may ask for less than the lane's context (the prompt and reply
        must then fit in it), never more: Ollama would size a context of that many tokens, and
        silently serving a smaller one would cut what the client counts on."""
        num_ctx = req.options.num_ctx if req.options is not None else None
        if num_ctx is None:
            return
        runtime = self._runtime(request, req.model)
        ctx = runtime.loop.settings.context_length
        if num_ctx > ctx:
            raise InvalidRequest(f"options.num_ctx is {num_ctx}, but this model's lanes hold {ctx} tokens; send "
                                 f"num_ctx {ctx} or less (the server's --max-context sets it)",
                                 param="options.num_ctx", code="context_length_exceeded")
        if num_ctx == ctx or not hasattr(typed, "messages"):
            return
        n_prompt = await asyncio.get_running_loop().run_in_executor(
            None, self.openai.preparer.chat_prompt_length, typed, model)
        if n_prompt >= num_ctx:
            raise InvalidRequest(f"the prompt is {n_prompt} tokens, more than options.num_ctx {num_ctx}",
                                 param="options.num_ctx", code="context_length_exceeded")

    # ---- embeddings -------------------------------------------------------------------------------

    async def embed(self, request: web.Request) -> web.Response:
        arrived = time.monotonic()
        req = await read_as(request, OllamaEmbedRequest)
        inputs = [req.input] if isinstance(req.input, str) else req.input
        body = parse(EmbeddingRequest, {"model": self._asked(request, req.model), "input": inputs,
                                        **({"dimensions": req.dimensions} if req.dimensions else {})})
        out = await self.embeddings.embed(request, body, arrived)
        return web.json_response({"model": req.model, "embeddings": [d["embedding"] for d in out["data"]],
                                  "total_duration": int((time.monotonic() - arrived) * 1e9), "load_duration": 0,
                                  "prompt_eval_count": out["usage"]["prompt_tokens"]})

    async def embeddings_v1(self, request: web.Request) -> web.Response:
        arrived = time.monotonic()
        req = await read_as(request, OllamaEmbeddingsRequest)
        body = parse(EmbeddingRequest, {"model": self._asked(request, req.model), "input": [req.prompt]})
        out = await self.embeddings.embed(request, body, arrived)
        return web.json_response({"embedding": out["data"][0]["embedding"]})

    # ---- models -----------------------------------------------------------------------------------

    async def root(self, request: web.Request) -> web.Response:
        return web.Response(text="Ollama is running")

    async def version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": OLLAMA_VERSION})

    def _names(self, request) -> list[tuple[str, object]]:
        """(name, runtime) of every served model, LoRA adapter and alias the key may use."""
        out = [(name, rt) for name, rt in list(self.daemon.models.items()) if rt.state == "ready"]
        # each LoRA adapter as a model of its own, MODEL:ADAPTER (Open WebUI lists these)
        out += [(f"{name}:{a.name}", rt) for name, rt in list(out) for a in rt.loop.adapters.served()]
        for alias in request.app.get(ALIASES) or ():
            rt = self.daemon.models.get(alias.model)
            if rt is not None and rt.state == "ready":
                out.append((alias.name, rt))
        return out

    async def tags(self, request: web.Request) -> web.Response:
        return web.json_response({"models": [_entry(name, rt) for name, rt in self._names(request)]})

    async def ps(self, request: web.Request) -> web.Response:
        models = []
        for name, rt in self._names(request):
            entry = _entry(name, rt)
            entry.update(expires_at="9999-12-31T23:59:59Z", size_vram=0,
                         context_length=rt.loop.settings.context_length)
            models.append(entry)
        return web.json_response({"models": models})

    async def show(self, request: web.Request) -> web.Response:
        req = await read_as(request, OllamaShowRequest)
        if not req.which:
            raise InvalidRequest("model is required", param="model", code="missing_required_parameter")
        try:
            runtime = self._runtime(request, req.which)
        except ModelNotFound:
            raise ModelNotFound(f"model '{req.which}' not found", param="model") from None
        info, caps, chat = runtime.engine.info, runtime.engine.capabilities, chat_of(runtime)
        arch = _details(runtime)["family"]
        capabilities = ["completion"] if getattr(caps, "generates", True) else []
        if _calls_tools(chat):
            capabilities.append("tools")
        if getattr(caps, "embeddings", False):
            capabilities.append("embedding")
        if info.fim_prefix is not None and info.fim_suffix is not None:
            capabilities.append("insert")
        if getattr(caps, "vision", False) and info.vision is not None:
            capabilities.append("vision")
        ctx = runtime.loop.settings.context_length
        return web.json_response({
            "modelfile": f"FROM {info.path}\n", "parameters": f"num_ctx {ctx}", "template": chat.template or "",
            "details": _details(runtime),
            "model_info": {"general.architecture": arch, f"{arch}.context_length": info.n_ctx_train or ctx,
                           f"{arch}.embedding_length": info.n_embd},
            "capabilities": capabilities, "modified_at": _modified(info.path),
            "superfluid": chat.describe()})  # which template, from where, and the formats its replies are read with


def _calls_tools(chat) -> bool:
    """Whether the model is known to call tools: its replies' tool-call format was detected (or
    chosen), or its template renders the tools it is offered."""
    return chat.detected.tool_format is not None or template_caps(chat.template).tools


def _modified(path: str) -> str:
    try:
        stamp = os.path.getmtime(path)
    except OSError:
        stamp = time.time()
    return datetime.fromtimestamp(stamp, timezone.utc).isoformat().replace("+00:00", "Z")


def _size(path: str) -> int:
    try:
        if os.path.isdir(path):
            return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)
        return os.path.getsize(path)
    except OSError:
        return 0


def _details(runtime) -> dict:
    path = runtime.engine.info.path
    family = "llama"
    quant = ""
    stem = os.path.basename(path).lower()
    for q in ("q4_0", "q4_1", "q4_k_m", "q5_k_m", "q8_0", "f16", "bf16", "f32"):
        if q in stem:
            quant = q.upper()
    return {"parent_model": "", "format": "gguf" if path.endswith(".gguf") else "safetensors", "family": family,
            "families": [family], "parameter_size": "", "quantization_level": quant}


def _entry(name: str, runtime) -> dict:
    path = runtime.engine.info.path
    return {"name": name, "model": name, "modified_at": _modified(path), "size": _size(path),
            "digest": hashlib.sha256(f"{name}:{path}".encode()).hexdigest(), "details": _details(runtime)}
