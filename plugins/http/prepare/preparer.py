"""One generation request, validated once: the body and headers become a frozen :class:`Prepared`
(model runtime, core Request, tool plan, stream flags) that the routes then only read.

Everything a client can get wrong is found here, as a 400 naming the field, before anything
reaches a model, but what the model's loop checks on submit for every front end (the prompt
against the context length, a generation from an embedding-only model, a schema llguidance
cannot enforce): this module does not repeat those."""

from __future__ import annotations

from typing import Callable

import attrs

from superfluid.core.chat import render_chat
from superfluid.core.errors import ContextLengthExceeded, InvalidRequest
from superfluid.core.request import Request, new_request_id

from ..body import check_fields
from ..keys.auth import applied_class, check_model, note_class, request_key
from . import logprob_format, params, response_format, tool_validate
from .fim import FIM_CLASS, FimPolicy, fim_prompt
from .qos_class import batch_invariant, request_class
from .tool_format import ToolPlan
from .tool_render import render_prompt

NO_TOOLS = ToolPlan()


@attrs.define(frozen=True)
class Prepared:
    """What the routes need to run and answer one generation; ``request.sink`` is its bridge."""

    kind: str  # "chat" | "completion" | "infill"
    runtime: object  # the daemon's ModelRuntime
    requests: tuple[Request, ...]  # one per choice (``n``), all with the same prompt
    tools: ToolPlan = NO_TOOLS  # inactive unless a chat offered tools
    stream: bool = False
    include_usage: bool = False  # a stream ends with a usage chunk
    logprobs: int | None = None  # the reply carries logprobs with this many top candidates
    echo: str | None = None  # a completion's echo: the prompt's text, which the reply starts with
    score_only: bool = False  # max_tokens 0 with echo: one token is generated, then dropped

    @property
    def request(self) -> Request:
        """The first choice's request (the only one unless ``n`` > 1)."""
        return self.requests[0]

    @property
    def bridge(self):
        """The sink of every choice's lane (:class:`~..bridge.EventBridge`): the first's request
        has it as its sink, the others :meth:`~..bridge.EventBridge.lane`."""
        return self.requests[0].sink


def max_tokens(body: dict, chat: bool, n_prompt: int, ctx: int, cap: int = 0, echo: bool = False) -> int:
    """OpenAI's defaults: the rest of the context for chat, 16 for completions; too many is a 400.
    A prompt that alone fills the context is the scheduler's to refuse (its error names the
    prompt, not this field), so it gets 1 here. ``cap`` (a key's ``max-tokens``, 0: none): asking
    for more is a 400 naming the field (a client told it was clamped could not tell a short reply
    from a cut one); the default is clamped to it. ``echo`` (a completion's): 0 is allowed, to
    score the prompt only (what lm-evaluation-harness sends)."""
    key = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    value = params.integer(body, key, None, 0 if echo else 1)
    if value == 0:
        return 0
    if cap and value is not None and value > cap:
        raise InvalidRequest(f"{key} is {value}, but this API key may ask for at most {cap} tokens per reply",
                             param=key, code="max_tokens_exceeded")
    if n_prompt >= ctx:
        return 1
    if value is None:
        value = ctx - n_prompt if chat else 16
        if cap:
            value = min(value, cap)
    if n_prompt + value > ctx:
        raise ContextLengthExceeded(
            f"This model's maximum context length is {ctx} tokens. However, you requested "
            f"{n_prompt + value} tokens ({n_prompt} in the prompt, {value} in the completion). "
            f"Please reduce the prompt or the completion length.", param=key)
    return min(value, ctx - n_prompt)



def _chat_tokens(runtime, text: str) -> list[int]:
    """A rendered chat as tokens: BOS added unless the template wrote it."""
    info = runtime.engine.info
    add_bos = info.add_bos and not (info.bos_token and text.startswith(info.bos_token))
    return runtime.engine.tokenize(text, add_special=add_bos, parse_special=True)


class Preparer:
    """Turns request bodies into :class:`Prepared` values for one daemon and configuration."""

    def __init__(self, daemon, config, fim: FimPolicy | None = None):
        self.daemon = daemon
        self.config = config
        self.fim = fim or FimPolicy(config)

    # ---- prompts ---------------------------------------------------------------------------

    @staticmethod
    def chat_prefix_tokens(runtime, messages: list[dict]) -> list[int]:
        """The tokens a conversation starting with ``messages`` begins with (no generation
        prompt): e.g. a session's system prompt, to pin its KV."""
        info = runtime.engine.info
        return _chat_tokens(runtime, render_chat(info.chat_template, messages, bos_token=info.bos_token,
                                                 eos_token=info.eos_token, add_generation_prompt=False))

    def chat_prompt(self, body: dict) -> tuple[object, list[int], ToolPlan]:
        """(runtime, prompt tokens, tool plan) of a chat body: tools and messages validated."""
        runtime = self.daemon.get(params.model_name(body))
        info = runtime.engine.info
        tools = tool_validate.plan(body, grammars=getattr(runtime.engine.capabilities, "grammars", False))
        messages = tool_validate.check_messages(params.chat_messages(body))
        text = render_prompt(info.chat_template, messages, tools, bos_token=info.bos_token,
                             eos_token=info.eos_token, add_generation_prompt=True)
        return runtime, _chat_tokens(runtime, text), tools

    def chat_prompt_length(self, body: dict) -> int:
        """How many tokens a chat body's prompt renders to (tools included); validates it."""
        return len(self.chat_prompt(body)[1])

    def _completion_prompt(self, body: dict) -> tuple[object, list[int]]:
        runtime = self.daemon.get(params.model_name(body))
        engine, info = runtime.engine, runtime.engine.info
        tokens = params.completion_prompt(body, lambda s: engine.tokenize(s, add_special=True, parse_special=True))
        bad = [t for t in tokens if not 0 <= t < info.n_vocab]
        if bad:
            raise InvalidRequest(f"token id {bad[0]} is outside the vocabulary (0..{info.n_vocab - 1})",
                                 param="prompt", code="invalid_value")
        return runtime, tokens

    def _fim_prompt(self, request, body: dict, kind: str) -> tuple[object, list[int]]:
        runtime = self.fim.runtime(self.daemon, params.model_name(body))
        if kind == "infill":
            prefix, suffix, middle = (params.text(body, "input_prefix"), params.text(body, "input_suffix"),
                                      params.text(body, "prompt"))
        else:
            prefix, suffix, middle = params.fim_parts(body), params.text(body, "suffix"), ""
        check_model(request, runtime.name)  # before the request spends a rate-limit token
        self.fim.admit(request)
        return runtime, fim_prompt(runtime, prefix, suffix, middle)

    # ---- the whole request -----------------------------------------------------------------

    def prepare(self, request, body: dict, kind: str, *, arrived: float,
                make_sink: Callable[[bool, int], Callable], qos: str | None = None) -> Prepared:
        """Validate ``body`` (and ``request``'s headers) for a ``kind`` generation. ``make_sink``
        (called with whether the reply streams and how many choices it has) gives the sink of
        their lanes (an :class:`~..bridge.EventBridge`); ``qos`` overrides the class the headers
        ask for (a session's)."""
        check_fields(body, params.FIELDS[kind])
        params.unsupported(body)
        n = params.choice_count(body)
        if n > 1 and kind == "infill":
            raise InvalidRequest("/infill answers one completion: n must be 1", param="n", code="unsupported_value")
        if kind == "infill" and "n_predict" in body and "max_tokens" not in body:
            n_predict = params.integer(body, "n_predict", -1, -1)  # llama.cpp's name; -1: the default
            body = {**body, "max_tokens": n_predict if n_predict != -1 else None}
        invariant = batch_invariant(request, self.config)
        fim = kind == "infill" or (kind == "completion" and body.get("suffix") is not None)
        if fim and params.boolean(body, "echo"):
            raise InvalidRequest("echo cannot be used with suffix", param="echo", code="invalid_value")
        tools = NO_TOOLS
        if fim:
            runtime, tokens = self._fim_prompt(request, body, kind)
        elif kind == "chat":
            runtime, tokens, tools = self.chat_prompt(body)
        else:
            runtime, tokens = self._completion_prompt(body)
        check_model(request, runtime.name)
        key = request_key(request)
        ctx = runtime.loop.settings.context_length
        stream = params.boolean(body, "stream")
        include_usage = bool((body.get("stream_options") or {}).get("include_usage")) if stream else False
        asked = _asked(body, kind, tools)
        _engine_serves(runtime, asked)
        limit = max_tokens(body, kind != "completion", len(tokens), ctx, key.max_tokens if key is not None else 0,
                           echo=asked.echo)
        sampling = attrs.evolve(params.sampling(body), logit_bias=params.logit_bias(body, runtime.engine.info.n_vocab),
                                logprobs=asked.logprobs)
        if tools.constraint is not None:  # a forced call: its rest held to the tools' schemas
            sampling = attrs.evolve(sampling, json_schema=tools.constraint)
        elif asked.json is not None:  # response_format: the whole reply held to its schema
            sampling = attrs.evolve(sampling, json_schema=asked.json)
        stop = params.stop_strings(body) + tools.stop
        ignore_eos, reuse = params.boolean(body, "ignore_eos"), params.boolean(body, "cache_prompt", True)
        cls = request_class(request, self.config, body)  # the header is validated also when overridden
        if fim or qos is not None:  # a session's class, or FIM's: capped at the key's class too
            cls = applied_class(request, self.config, asked=FIM_CLASS if qos is None else qos)
        note_class(request, cls)
        bridge = make_sink(stream, n)
        first = Request(
            prompt_tokens=tokens, max_tokens=max(limit, 1), sink=bridge, sampling=sampling, stop=stop,
            ignore_eos=ignore_eos, batch_invariant=invariant, reuse_prefix=reuse, streamed=stream,
            qos=cls, start_deadline=self.fim.deadline(arrived) if fim else None,
            prompt_logprobs=asked.logprobs if asked.echo else None,
            arrived=arrived, meta=_meta(kind, fim, sampling, tools, _tenant(key, body)))
        requests = (first, *(_sibling(first, bridge, i) for i in range(1, n)))
        echo = _echo_text(runtime, tokens) if asked.echo else None
        return Prepared(kind=kind, runtime=runtime, requests=requests, tools=tools, stream=stream,
                        include_usage=include_usage, logprobs=asked.logprobs, echo=echo, score_only=limit == 0)


@attrs.define(frozen=True)
class _Asked:
    """The output features a body asks for, validated: what the model's engine must serve."""

    logprobs: int | None = None
    echo: bool = False
    json: object = None  # response_format's JsonConstraint
    logit_bias: bool = False


def _asked(body: dict, kind: str, tools: ToolPlan) -> _Asked:
    if kind == "infill":
        if body.get("logprobs") not in (None, False, 0):
            raise InvalidRequest("/infill answers no logprobs; use /v1/completions with suffix", param="logprobs",
                                 code="unsupported_value")
        return _Asked(logit_bias=bool(body.get("logit_bias")))
    logprobs = logprob_format.chat_request(body) if kind == "chat" else logprob_format.completion_request(body)
    echo = kind == "completion" and params.boolean(body, "echo")  # (not with suffix: refused before)
    json = response_format.constraint(body) if kind == "chat" else None
    if json is not None and tools.choice in ("required", "function"):
        raise InvalidRequest("a forced tool call (tool_choice \"required\" or a function) cannot also follow a "
                             "JSON response_format", param="response_format", code="invalid_value")
    return _Asked(logprobs=logprobs, echo=echo, json=json, logit_bias=bool(body.get("logit_bias")))


def _engine_serves(runtime, asked: _Asked) -> None:
    """A feature the model's engine lacks is a 400 naming the field that asked for it."""
    caps, name = runtime.engine.capabilities, runtime.name
    needs = ((asked.json is not None, "grammars", "response_format", "constrained (JSON) output"),
             (asked.logprobs is not None, "logprobs", "logprobs", "logprobs"),
             (asked.logit_bias, "logit_bias", "logit_bias", "logit_bias"))
    for wanted, cap, field, what in needs:
        if wanted and not getattr(caps, cap, False):
            raise InvalidRequest(f"model {name!r} does not support {what}: its engine lacks it", param=field,
                                 code="unsupported_value")


def _sibling(first: Request, bridge, index: int) -> Request:
    """Choice ``index`` of an n-choice request: the same prompt, its own lane and sink, its own seed
    (seed + index) when one was given; only the first scores the prompt (the scores are shared)."""
    sampling = first.sampling
    if sampling.seed is not None:
        seed = sampling.seed + index
        sampling = attrs.evolve(sampling, seed=seed if seed < 1 << 64 else seed - (1 << 64))
    return attrs.evolve(first, id=new_request_id(), sink=bridge.lane(index), sampling=sampling,
                        prompt_logprobs=None, meta={**first.meta, "choice": index})


def _meta(kind: str, fim: bool, sampling, tools: ToolPlan, tenant: str | None = None) -> dict:
    """The Request's notes for the model: a chat's prompt is its messages; a constraint its loop
    finds it cannot enforce came from this field (its 400 names it); ``tenant`` (the API key's
    name, else the body's ``user``) is whom the request is for, for a policy that shares lanes
    fairly."""
    meta = {"chat": kind == "chat", "fim": fim}
    if tenant is not None:
        meta["tenant"] = tenant
    if sampling.constrained:
        meta["constraint_param"] = "tools" if tools.constraint is not None else "response_format"
    return meta


def _tenant(key, body: dict) -> str | None:
    """Whom a request is for: its API key's name under a key policy, else the body's ``user``."""
    if key is not None:
        return f"key:{key.name}"
    user = params.text(body, "user")
    return f"user:{user}" if user else None


def _echo_text(runtime, tokens: list[int]) -> str:
    """The prompt as text, from its tokens (special tokens render as nothing)."""
    token_bytes = runtime.engine.token_bytes
    return b"".join(bytes(token_bytes(t)) for t in tokens).decode("utf-8", errors="replace")
