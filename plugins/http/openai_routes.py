"""POST /v1/completions and /v1/chat/completions: validate, tokenize, submit, stream back."""

from __future__ import annotations

import asyncio
import json
import time
import uuid

import attrs
from aiohttp import web

from superfluid.core import qos as qos_classes
from superfluid.core.errors import ContextLengthExceeded, InvalidRequest, SuperfluidError
from superfluid.core.request import Request

from . import params, tool_calls
from .access_log import log_generation
from .bridge import EventBridge
from .errors import error_response, from_exception
from .fim import FIM_CLASS, FimPolicy, fim_prompt

QOS_HEADER = "x-superfluid-qos"
BATCH_INVARIANT_HEADER = "x-superfluid-batch-invariant"
TOOLS_KEY = "superfluid.tools"  # a chat request's ToolPlan, kept on the aiohttp request
_NO_TOOLS = tool_calls.ToolPlan()


def _tools(request) -> tool_calls.ToolPlan:
    return request.get(TOOLS_KEY) or _NO_TOOLS


def _sampling(body: dict, tools: tool_calls.ToolPlan):
    """The body's sampling, constrained by a forced tool call's grammar where there is one."""
    sampling = params.sampling(body)
    return attrs.evolve(sampling, grammar=tools.grammar) if tools.grammar else sampling


async def read_body(request: web.Request) -> dict:
    raw = await request.read()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise InvalidRequest("request body is not valid UTF-8", code="invalid_encoding") from None
    if not text.strip():
        raise InvalidRequest("request body is empty; send a JSON object", code="invalid_body")
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidRequest(f"request body is not valid JSON: {exc}", code="invalid_json") from None


def request_class(request: web.Request, config) -> str:
    header = request.headers.get(QOS_HEADER)
    if header is not None and config["http-qos-header"]:
        return qos_classes.resolve(header)
    return config["http-default-qos"]


def _max_tokens(body: dict, chat: bool, n_prompt: int, ctx: int) -> int:
    """OpenAI's defaults: the rest of the context for chat, 16 for completions; too many is a 400."""
    key = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    value = params.integer(body, key, None, 1)
    if value is None:
        value = ctx - n_prompt if chat else 16
    if n_prompt + value > ctx:
        raise ContextLengthExceeded(
            f"This model's maximum context length is {ctx} tokens. However, you requested "
            f"{n_prompt + value} tokens ({n_prompt} in the prompt, {value} in the completion). "
            f"Please reduce the prompt or the completion length.", param=key)
    return max(1, min(value, ctx - n_prompt))


def batch_invariant(request: web.Request, config) -> bool:
    """The x-superfluid-batch-invariant header; a 403 unless --http-allow-batch-invariant."""
    raw = request.headers.get(BATCH_INVARIANT_HEADER)
    if raw is None:
        return False
    value = raw.strip().lower()
    if value in ("0", "false", "no", "off", ""):
        return False
    if value not in ("1", "true", "yes", "on"):
        raise InvalidRequest(f"{BATCH_INVARIANT_HEADER} must be true or false, got {raw!r}",
                             param=BATCH_INVARIANT_HEADER, code="invalid_value")
    if not config["http-allow-batch-invariant"]:
        raise Forbidden("batch-invariant lanes tick alone and can serialize the server; this server "
                        "does not allow them (start it with --http-allow-batch-invariant)",
                        param=BATCH_INVARIANT_HEADER, code="batch_invariant_not_allowed")
    return True


class Forbidden(SuperfluidError):
    status = 403
    type = "permission_error"


class OpenAIRoutes:
    def __init__(self, daemon, config, catchup=None):
        self.daemon = daemon
        self.config = config
        self.catchup = catchup  # the front end's LoopCatchup: its bridges count wake-ups on it
        self.fim = FimPolicy(config)

    def add_to(self, app: web.Application) -> None:
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/infill", self.infill)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "chat")

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "completion")

    async def infill(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "infill")

    @staticmethod
    def chat_prefix_tokens(runtime, messages: list[dict]) -> list[int]:
        """The tokens a conversation starting with ``messages`` begins with (no generation
        prompt): e.g. a session's system prompt, to pin its KV."""
        from superfluid.core.chat import render_chat
        info = runtime.engine.info
        text = render_chat(info.chat_template, messages, bos_token=info.bos_token,
                           eos_token=info.eos_token, add_generation_prompt=False)
        add_bos = info.add_bos and not (info.bos_token and text.startswith(info.bos_token))
        return runtime.engine.tokenize(text, add_special=add_bos, parse_special=True)

    def chat_prompt_length(self, request: web.Request, body: dict) -> int:
        """How many tokens a chat body's prompt renders to (tools included); validates it."""
        return len(self._tokens(request, body, "chat")[1])

    async def generate_chat(self, request: web.Request, body: dict, qos: str, on_finish) -> web.StreamResponse:
        """A chat completion for another route (a session's turn): ``body`` instead of the
        request's JSON, a fixed QoS class, and ``on_finish(text, event, prompt_tokens, parsed)``
        (``parsed``: the reply split into content and tool calls, when tools were offered)."""
        return await self._generate(request, "chat", body=body, qos=qos, on_finish=on_finish)

    # ---- building the request ------------------------------------------------------------------

    def _tokens(self, request, body: dict, kind: str):
        """(runtime, prompt tokens, is FIM) for a validated body."""
        model = body.get("model")
        if model is not None and not isinstance(model, str):
            raise InvalidRequest("model must be a string", param="model", code="invalid_type")
        if kind == "infill" or (kind == "completion" and body.get("suffix") is not None):
            runtime = self.fim.runtime(self.daemon, model)
            if kind == "infill":
                prefix, suffix, middle = (params.text(body, "input_prefix"), params.text(body, "input_suffix"),
                                          params.text(body, "prompt"))
            else:
                prefix, suffix, middle = params.fim_parts(body), params.text(body, "suffix"), ""
            self.fim.admit(request)
            return runtime, fim_prompt(runtime, prefix, suffix, middle), True
        runtime = self.daemon.get(model)
        engine, info = runtime.engine, runtime.engine.info
        if kind == "chat":
            tools = tool_calls.plan(body, grammars=getattr(engine.capabilities, "grammars", False))
            request[TOOLS_KEY] = tools  # read back by _prepare, _collect and _stream
            text = tool_calls.render_prompt(info.chat_template, tool_calls.check_messages(params.chat_messages(body)),
                                            tools, bos_token=info.bos_token, eos_token=info.eos_token,
                                            add_generation_prompt=True)
            add_bos = info.add_bos and not (info.bos_token and text.startswith(info.bos_token))
            return runtime, engine.tokenize(text, add_special=add_bos, parse_special=True), False
        tokens = params.completion_prompt(body, lambda s: engine.tokenize(s, add_special=True, parse_special=True))
        bad = [t for t in tokens if not 0 <= t < info.n_vocab]
        if bad:
            raise InvalidRequest(f"token id {bad[0]} is outside the vocabulary (0..{info.n_vocab - 1})",
                                 param="prompt", code="invalid_value")
        return runtime, tokens, False

    def _prepare(self, request: web.Request, body: dict, kind: str, arrived: float):
        params.check_fields(body, params.FIELDS[kind])
        params.unsupported(body)
        if kind == "infill" and "n_predict" in body and "max_tokens" not in body:
            body = {**body, "max_tokens": body["n_predict"] if body["n_predict"] != -1 else None}
        invariant = batch_invariant(request, self.config)
        runtime, tokens, fim = self._tokens(request, body, kind)
        ctx = runtime.scheduler.settings.context_length
        if len(tokens) >= ctx:
            raise ContextLengthExceeded(
                f"This model's maximum context length is {ctx} tokens, but the prompt has "
                f"{len(tokens)} tokens.", param="messages" if kind == "chat" else "prompt")
        stream = params.boolean(body, "stream")
        opts = body.get("stream_options") or {}
        include_usage = bool(opts.get("include_usage")) if stream else False
        req_args = dict(
            prompt_tokens=tokens, max_tokens=_max_tokens(body, kind != "completion", len(tokens), ctx),
            sampling=_sampling(body, _tools(request)), stop=params.stop_strings(body) + _tools(request).stop,
            ignore_eos=params.boolean(body, "ignore_eos"), batch_invariant=invariant,
            reuse_prefix=params.boolean(body, "cache_prompt", True), streamed=stream,
            qos=FIM_CLASS if fim else request_class(request, self.config),
            start_deadline=self.fim.deadline(arrived) if fim else None,
            meta={"chat": kind == "chat", "fim": fim})
        return runtime, req_args, stream, include_usage

    async def _generate(self, request: web.Request, kind: str, body: dict | None = None,
                        qos: str | None = None, on_finish=None) -> web.StreamResponse:
        """Run one generation. ``body`` (default: the request's JSON) and ``qos`` (default: from the
        headers) let other routes (sessions) reuse this; ``on_finish`` hears the complete reply
        before the response ends (see :meth:`generate_chat`)."""
        arrived = time.monotonic()
        if body is None:
            body = await read_body(request)
        runtime, req_args, stream, include_usage = self._prepare(request, body, kind, arrived)
        if qos is not None:
            req_args["qos"] = qos
        bridge = EventBridge(asyncio.get_running_loop(), hold_deltas=not stream, catchup=self.catchup)
        req = Request(sink=bridge, arrived=arrived, **req_args)
        runtime.scheduler.submit(req)
        shape = _Shape(kind=kind, model=runtime.name)
        shape.on_finish, shape.prompt_tokens = on_finish, req.prompt_tokens
        log_args = dict(model=runtime.name, qos=req.qos, prompt_tokens=len(req.prompt_tokens), arrived=arrived)
        try:
            if stream:
                return await self._stream(request, bridge, shape, include_usage, log_args)
            return await self._collect(request, bridge, shape, log_args)
        except (ConnectionResetError, asyncio.CancelledError):
            # The client went away: the lane is cancelled below and frees its KV at the next step.
            log_generation(request, status=499, completion_tokens=0, timings={}, finish="disconnected",
                           **log_args)
            raise
        finally:
            if not bridge.done:
                runtime.scheduler.cancel(req.id)

    async def _collect(self, request, bridge: EventBridge, shape: "_Shape", log_args) -> web.Response:
        text = []
        async for event in bridge.events():
            if event.kind == "delta":
                text.append(event.text)
            elif event.kind == "error":
                log_generation(request, status=_status(event.error), completion_tokens=0,
                               timings=event.timings, finish="error", **log_args)
                return _error_response(event.error)
            elif event.kind == "finished":
                log_generation(request, status=200, completion_tokens=event.completion_tokens,
                               timings=event.timings, finish=event.finish_reason, **log_args)
                tools = _tools(request)
                reply = tools.prefill + "".join(text)  # the pre-fill is "" unless a call is forced
                parsed = tool_calls.parse(reply, event.finish_reason, tools) if tools.active else None
                shape.finished(reply, event, parsed)
                return web.json_response(shape.whole(reply, event, parsed))
        raise AssertionError("event stream ended without a final event")

    async def _stream(self, request, bridge: EventBridge, shape: "_Shape", include_usage: bool,
                      log_args) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        await resp.prepare(request)
        if shape.kind == "chat":
            await _send(resp, shape.chunk(role=True))
        tools = _tools(request)
        parser = tool_calls.StreamParser(tools) if tools.active else None
        async for event in bridge.events():
            if event.kind == "delta":
                if event.text:
                    shape.streamed.append(event.text)
                    text = parser.feed(event.text) if parser else event.text
                    if text:
                        await _send(resp, shape.chunk(text=text))
            elif event.kind == "error":
                log_generation(request, status=_status(event.error), completion_tokens=0,
                               timings=event.timings, finish="error", **log_args)
                await _send(resp, _error_body(event.error))
                break
            elif event.kind == "finished":
                finish, parsed = event.finish_reason, None
                if parser:  # what was held back: the rest of the content, then the calls whole
                    rest, parsed = parser.finish(finish)
                    if rest:
                        await _send(resp, shape.chunk(text=rest))
                    if parsed.calls:
                        await _send(resp, shape.chunk(tool_calls=tool_calls.stream_deltas(parsed.calls)))
                    finish = parsed.finish_reason
                shape.finished(tools.prefill + "".join(shape.streamed), event, parsed)
                await _send(resp, shape.chunk(finish=finish, event=event))
                if include_usage:
                    await _send(resp, shape.usage_chunk(event))
                log_generation(request, status=200, completion_tokens=event.completion_tokens,
                               timings=event.timings, finish=event.finish_reason, **log_args)
        if shape.kind != "infill":
            await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


def _server_timings(event) -> dict:
    """The server's own view of a request, in llama.cpp server's names plus queue and TTFT:
    what a client needs to tell queueing, prefill and decode apart."""
    t = event.timings or {}

    def ms(start: str, end: str) -> float | None:
        if t.get(start) is None or t.get(end) is None:
            return None
        return round((t[end] - t[start]) * 1000, 3)

    return {"queued_ms": ms("arrived", "admitted_at"), "ttft_ms": ms("arrived", "first_token_at"),
            "prompt_n": t.get("prefilled", 0), "prompt_ms": ms("admitted_at", "first_token_at"),
            "predicted_n": event.completion_tokens, "predicted_ms": ms("first_token_at", "finished_at")}


async def _send(resp: web.StreamResponse, obj: dict) -> None:
    await resp.write(b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n")


def _status(exc: BaseException | None) -> int:
    return exc.status if isinstance(exc, SuperfluidError) else 500


def _error_body(exc: BaseException | None) -> dict:
    if isinstance(exc, SuperfluidError):
        return exc.to_body()
    return {"error": {"message": str(exc), "type": "server_error", "param": None, "code": None}}


def _error_response(exc: BaseException | None) -> web.Response:
    if isinstance(exc, SuperfluidError):
        return from_exception(exc)
    return error_response(500, f"generation failed: {exc}")


class _Shape:
    """Builds response objects for one request: OpenAI chat or text completion, or llama.cpp infill."""

    def __init__(self, kind: str, model: str):
        self.kind = kind
        self.model = model
        self.created = int(time.time())
        self.id = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]
        self.on_finish = None  # on_finish(text, event, prompt_tokens, parsed tool calls): for a session's log
        self.prompt_tokens: list[int] = []
        self.streamed: list[str] = []

    def finished(self, text: str, event, parsed=None) -> None:
        if self.on_finish is not None:
            self.on_finish(text, event, self.prompt_tokens, parsed)

    def _usage(self, event) -> dict:
        return {"prompt_tokens": event.prompt_tokens, "completion_tokens": event.completion_tokens,
                "total_tokens": event.prompt_tokens + event.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": event.cached_tokens}}

    def whole(self, text: str, event, parsed: "tool_calls.Parsed | None" = None) -> dict:
        if self.kind == "infill":
            return {"content": text, "model": self.model, "stop": True,
                    "finish_reason": event.finish_reason, "tokens_predicted": event.completion_tokens,
                    "tokens_evaluated": event.prompt_tokens, "usage": self._usage(event)}
        if self.kind == "chat":
            message = {"role": "assistant", "content": text}
            finish = event.finish_reason
            if parsed is not None:  # tools were offered: the reply split into content and calls
                message["content"], finish = parsed.content, parsed.finish_reason
                if parsed.calls:
                    message["tool_calls"] = parsed.calls
            choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": finish}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": event.finish_reason}
            obj = "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "choices": [choice], "usage": self._usage(event), "timings": _server_timings(event)}

    def chunk(self, text: str = "", finish: str | None = None, role: bool = False, event=None,
              tool_calls: list | None = None) -> dict:
        if self.kind == "infill":
            out = {"content": text, "stop": finish is not None}
            if event is not None:
                out.update(finish_reason=finish, tokens_predicted=event.completion_tokens,
                           tokens_evaluated=event.prompt_tokens)
            return out
        if self.kind == "chat":
            delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
            if tool_calls:
                delta["tool_calls"] = tool_calls
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            obj = "chat.completion.chunk"
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
            obj = "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "choices": [choice]}

    def usage_chunk(self, event) -> dict:
        return {"id": self.id, "object": "chat.completion.chunk" if self.kind == "chat" else "text_completion",
                "created": self.created, "model": self.model, "choices": [], "usage": self._usage(event),
                "timings": _server_timings(event)}
