"""One generation request, prepared once: a typed request (parsed at its route, so its fields
already have their types and ranges) and the HTTP headers become a frozen :class:`Prepared`
(model runtime, core Request, tool plan, stream flags) that the routes then only read.

What needs the served model is checked here, as a 400 naming the field, before anything reaches
it (token ids against the vocabulary, max_tokens against the context, features the engine
lacks); what the model's loop checks on submit for every front end (the prompt against the
context length, a generation from an embedding-only model, a schema llguidance cannot
enforce) is not repeated. Other front ends (sessions; Messages, Responses, Ollama) reuse this
path: a chat's prompt is rendered from its :attr:`~..openai.chat_protocol.ChatFields.conversation`
(:class:`~superfluid.core.formats.conversation.Conversation`), which each front end maps from its
own typed request, and its generation parameters are chat's typed fields."""

from __future__ import annotations

from typing import Callable

import attrs

from superfluid.core.chat import render_chat, template_caps
from superfluid.core.errors import ContextLengthExceeded, InvalidRequest
from superfluid.core.formats.conversation import Conversation
from superfluid.core.formats.setup import chat_of
from superfluid.core.formats.template_messages import content_caps, template_messages
from superfluid.core.media import MediaSpan
from superfluid.core.request import Request, new_request_id

from ..keys.auth import applied_class, check_model, note_class, request_key
from ..openai.chat_protocol import ChatFields
from ..openai.protocol import CompletionRequest, InfillRequest
from . import logprob_format, params, reply_read, response_format, tool_plan
from ..aliases import Aliases
from ..lora import request_adapters
from .fim import FIM_CLASS, FimPolicy, fim_prompt
from .image_prompt import tokenize_with_images
from .qos_class import batch_invariant, request_class
from .reasoning import Reasoning, reasoning_of, render_flags, template_kwargs, thinking_budget
from .tool_format import ToolPlan
from .tool_render import render_prompt, reply_format

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
    reasoning: "Reasoning | None" = None  # a reasoning model's chat: how its reply is split
    reader: object = None  # a chat's ReplyReader: the reply read into content, reasoning and calls

    @property
    def request(self) -> Request:
        """The first choice's request (the only one unless ``n`` > 1)."""
        return self.requests[0]

    @property
    def bridge(self):
        """The sink of every choice's lane (:class:`~..bridge.EventBridge`): the first's request
        has it as its sink, the others :meth:`~..bridge.EventBridge.lane`."""
        return self.requests[0].sink


def max_tokens(asked: int | None, key: str, chat: bool, n_prompt: int, ctx: int, cap: int = 0,
               echo: bool = False, ceiling: bool = False) -> int:
    """The reply's limit from the field ``key`` (``asked``: its value, None: absent). OpenAI's
    defaults: the rest of the context for chat, 16 for completions; too many is a 400. A prompt
    that alone fills the context is the scheduler's to refuse (its error names the prompt, not
    this field), so it gets 1 here. ``cap`` (a key's ``max-tokens``, 0: none): asking for more is
    a 400 naming the field (a client told it was clamped could not tell a short reply from a cut
    one); the default is clamped to it. ``echo`` (a completion's): 0 is allowed, to score the
    prompt only (what lm-evaluation-harness sends). ``ceiling``: the asked value is a ceiling cut
    to what the context leaves and to the key's cap (Anthropic's ``max_tokens``: Claude Code asks
    32000 of any model), not a demand refused when the context or the key cannot grant it."""
    value = asked
    if value is not None and value < 1 and not echo:
        raise InvalidRequest(f"{key} must be at least 1, got {value} (0 only with echo)", param=key,
                             code="invalid_value")
    if value == 0:
        return 0
    if ceiling and cap and value is not None:
        value = min(value, cap)  # a ceiling meets the key's cap: cut to it, as to the context
    if cap and value is not None and value > cap:
        raise InvalidRequest(f"{key} is {value}, but this API key may ask for at most {cap} tokens per reply",
                             param=key, code="max_tokens_exceeded")
    if n_prompt >= ctx:
        return 1
    if ceiling and value is not None:
        value = min(value, ctx - n_prompt)
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


def limit_field(req) -> tuple[int | None, str]:
    """(the asked limit, the field that asked it) of a typed generation request."""
    if isinstance(req, InfillRequest):
        return req.limit, "max_tokens" if req.max_tokens is not None or req.n_predict is None else "n_predict"
    if isinstance(req, ChatFields) and req.max_completion_tokens is not None:
        return req.max_completion_tokens, "max_completion_tokens"
    return req.max_tokens, "max_tokens"


def kind_of(req) -> str:
    """"chat" | "completion" | "infill": the kind of generation a typed request is."""
    if isinstance(req, ChatFields):
        return "chat"
    return "infill" if isinstance(req, InfillRequest) else "completion"


def _chat_tokens(runtime, text: str) -> list[int]:
    """A rendered chat as tokens: BOS added unless the template wrote it."""
    info = runtime.engine.info
    add_bos = info.add_bos and not (info.bos_token and text.startswith(info.bos_token))
    return runtime.engine.tokenize(text, add_special=add_bos, parse_special=True)


class Preparer:
    """Turns request bodies into :class:`Prepared` values for one daemon and configuration."""

    def __init__(self, daemon, config, fim: FimPolicy | None = None, aliases: Aliases | None = None):
        self.daemon = daemon
        self.config = config
        self.fim = fim or FimPolicy(config)
        self.aliases = aliases if aliases is not None else Aliases([], [])  # model-alias

    # ---- prompts ---------------------------------------------------------------------------

    @staticmethod
    def chat_prefix_tokens(runtime, conversation: Conversation) -> list[int]:
        """The tokens a conversation starting with ``conversation`` begins with (no generation
        prompt): e.g. a session's system prompt, to pin its KV."""
        info, template = runtime.engine.info, chat_of(runtime).template
        messages = template_messages(conversation, template_caps(template) if template else None,
                                                  content_caps(template))
        return _chat_tokens(runtime, render_chat(template, messages, bos_token=info.bos_token,
                                                 eos_token=info.eos_token, add_generation_prompt=False))

    def chat_runtime(self, req, model: str | None = None):
        """The served model a chat request (or a session's turn, ``model``) runs on."""
        return self.daemon.get(self.aliases.model(getattr(req, "model", None) or model))

    def chat_prompt(self, req, model: str | None = None) -> tuple[object, list[int], ToolPlan, tuple[MediaSpan, ...]]:
        """(runtime, prompt tokens, tool plan, image spans) of a chat request
        (:class:`ChatFields`); ``model`` stands in for a request without one (a session's turn).
        Images are laid out where their parts were (:mod:`.image_prompt`); a model that takes
        none refuses them."""
        return self._chat_prompt(req, model)[:4]

    def _chat_prompt(self, req, model: str | None = None):
        """:meth:`chat_prompt` and the rendered prompt's text."""
        runtime = self.chat_runtime(req, model)
        info, chat = runtime.engine.info, chat_of(runtime)
        conversation = req.conversation
        images = [image.ref for image in conversation.images()]
        if images:
            runtime.loop.check_takes_images()
        kwargs = dict(bos_token=info.bos_token, eos_token=info.eos_token, **template_kwargs(req))
        fmt = reply_format(chat, self.daemon)
        grammars = getattr(runtime.engine.capabilities, "grammars", False)
        tools = tool_plan.plan(req, fmt, grammars)
        text = render_prompt(chat.template, conversation, tools, **render_flags(req), **kwargs)
        span = chat.detected.reasoning
        if tools.prefill and span is not None and span.opened_by(text[:len(text) - len(tools.prefill)]):
            # the generation prompt opened a reasoning span: the forced call's pre-fill closes it
            head = text[:len(text) - len(tools.prefill)]
            tools = tool_plan.plan(req, fmt, grammars, opened=span.end)
            text = head + tools.prefill
        if not images:
            return runtime, _chat_tokens(runtime, text), tools, (), text
        tokens, spans = tokenize_with_images(runtime, text, images, lambda t: _chat_tokens(runtime, t))
        return runtime, tokens, tools, spans, text

    def chat_text(self, req, model: str | None = None) -> str:
        """The prompt text a chat request renders to (tools, images' markers and a forced call's
        pre-fill included): what ``/apply-template`` shows."""
        return self._chat_prompt(req, model)[4]

    def chat_prompt_length(self, req, model: str | None = None) -> int:
        """How many tokens a chat request's prompt renders to (tools and images included)."""
        return len(self.chat_prompt(req, model)[1])

    def _completion_prompt(self, req: CompletionRequest) -> tuple[object, list[int]]:
        runtime = self.daemon.get(self.aliases.model(req.model))
        engine, info = runtime.engine, runtime.engine.info
        tokens = params.completion_prompt(req.prompt, lambda s: engine.tokenize(s, add_special=True, parse_special=True))
        bad = [t for t in tokens if not 0 <= t < info.n_vocab]
        if bad:
            raise InvalidRequest(f"token id {bad[0]} is outside the vocabulary (0..{info.n_vocab - 1})",
                                 param="prompt", code="invalid_value")
        return runtime, tokens

    def _fim_prompt(self, request, req) -> tuple[object, list[int]]:
        runtime = self.fim.runtime(self.daemon, req.model)
        if isinstance(req, InfillRequest):
            prefix, suffix, middle = req.input_prefix, req.input_suffix, req.prompt
        else:
            prefix, suffix, middle = params.fim_prefix(req.prompt), req.suffix, ""
        check_model(request, runtime.name)  # before the request spends a rate-limit token
        self.fim.admit(request)
        return runtime, fim_prompt(runtime, prefix, suffix, middle)

    # ---- the whole request -----------------------------------------------------------------

    def prepare(self, request, req, *, arrived: float, make_sink: Callable[[bool, int], Callable],
                qos: str | None = None, model: str | None = None, limit_is_ceiling: bool = False) -> Prepared:
        """A typed generation request (chat, completion or infill; a session's turn is a chat
        whose ``model`` is given here) checked against its model and ``request``'s headers.
        ``make_sink`` (called with whether the reply streams and how many choices it has) gives
        the sink of their lanes (an :class:`~..bridge.EventBridge`); ``qos`` overrides the class
        the headers ask for (a session's); ``limit_is_ceiling``: see :func:`max_tokens`."""
        kind = kind_of(req)
        n = req.n
        invariant = batch_invariant(request, self.config)
        fim = kind == "infill" or (kind == "completion" and req.suffix is not None)
        tools = NO_TOOLS
        media: tuple[MediaSpan, ...] = ()
        thinks = None
        if fim:
            runtime, tokens = self._fim_prompt(request, req)
        elif kind == "chat":
            runtime, tokens, tools, media, text = self._chat_prompt(req, model)
            thinks = reasoning_of(runtime, text[:len(text) - len(tools.prefill)])
            if any(span.image.width == 0 for span in media):
                raise RuntimeError("a chat's images must be loaded (ImageLoader) before it is prepared")
        else:
            runtime, tokens = self._completion_prompt(req)
        check_model(request, runtime.name)
        key = request_key(request)
        ctx = runtime.loop.settings.context_length
        stream = bool(req.stream)
        include_usage = bool(stream and req.stream_options is not None and req.stream_options.include_usage)
        asked = _asked(req, kind, tools)
        _engine_serves(runtime, asked)
        wanted, field = limit_field(req)
        limit = max_tokens(wanted, field, kind != "completion", len(tokens), ctx,
                           key.max_tokens if key is not None else 0, echo=asked.echo, ceiling=limit_is_ceiling)
        sampling = attrs.evolve(params.sampling(req), logit_bias=params.logit_bias(req, runtime.engine.info.n_vocab),
                                logprobs=asked.logprobs)
        if tools.constraint is not None:  # a forced call: its rest held to the tools' schemas
            sampling = attrs.evolve(sampling, json_schema=tools.constraint)
        elif asked.json is not None:  # response_format: the whole reply held to its schema
            sampling = attrs.evolve(sampling, json_schema=asked.json)
            thinks = None
        elif asked.grammar:  # llama-server's grammar: the reply held to a GBNF grammar
            sampling = attrs.evolve(sampling, grammar=asked.grammar)
        if tools.prefill and thinks is not None and not thinks.inside:
            thinks = None  # the reply is the call from its first token: no span to read
        sampling = thinking_budget(req, runtime, thinks, sampling)
        stop = params.stop_strings(req) + tools.stop
        named = getattr(req, "model", None) or model
        adapters = request_adapters(runtime, self.aliases.model(named), getattr(req, "lora", None))
        # the header is validated also when overridden
        cls = request_class(request, self.config, req.superfluid, otherwise=self.aliases.qos(named))
        if fim or qos is not None:  # a session's class, or FIM's: capped at the key's class too
            cls = applied_class(request, self.config, asked=FIM_CLASS if qos is None else qos)
        note_class(request, cls)
        bridge = make_sink(stream, n)
        first = Request(
            prompt_tokens=tokens, max_tokens=max(limit, 1), sink=bridge, sampling=sampling, stop=stop,
            ignore_eos=bool(req.ignore_eos), batch_invariant=invariant, media=media, reuse_prefix=req.cache_prompt is not False,
            streamed=stream, qos=cls, start_deadline=self.fim.deadline(arrived) if fim else None,
            prompt_logprobs=asked.logprobs if asked.echo else None, adapters=adapters,
            arrived=arrived, meta=_meta(kind, fim, sampling, tools, _tenant(key, req)))
        requests = (first, *(_sibling(first, bridge, i) for i in range(1, n)))
        echo = _echo_text(runtime, tokens) if asked.echo else None
        return Prepared(kind=kind, runtime=runtime, requests=requests, tools=tools, stream=stream,
                        include_usage=include_usage, logprobs=asked.logprobs, echo=echo, score_only=limit == 0,
                        reasoning=thinks, reader=reply_read.reader(tools, thinks) if kind == "chat" else None)


@attrs.define(frozen=True)
class _Asked:
    """The output features a body asks for, validated: what the model's engine must serve."""

    logprobs: int | None = None
    echo: bool = False
    json: object = None  # response_format's JsonConstraint
    logit_bias: bool = False
    grammar: str | None = None  # llama-server's ``grammar``: GBNF text


def _asked(req, kind: str, tools: ToolPlan) -> _Asked:
    if kind == "infill":
        return _Asked(logit_bias=bool(req.logit_bias))
    logprobs = logprob_format.chat_request(req) if kind == "chat" else logprob_format.completion_request(req)
    echo = kind == "completion" and bool(req.echo)  # (not with suffix: refused when parsed)
    json = response_format.constraint(req.response_format) if kind == "chat" else None
    if json is not None and tools.choice in ("required", "function"):
        raise InvalidRequest("a forced tool call (tool_choice \"required\" or a function) cannot also follow a "
                             "JSON response_format", param="response_format", code="invalid_value")
    grammar = getattr(req, "grammar", None) or None
    if grammar is not None and json is not None:
        raise InvalidRequest("grammar and a JSON response_format cannot both hold the reply: send one",
                             param="grammar", code="invalid_value")
    if grammar is not None and tools.choice in ("required", "function"):
        raise InvalidRequest("a forced tool call (tool_choice \"required\" or a function) cannot also follow a "
                             "grammar", param="grammar", code="invalid_value")
    return _Asked(logprobs=logprobs, echo=echo, json=json, logit_bias=bool(req.logit_bias), grammar=grammar)


def _engine_serves(runtime, asked: _Asked) -> None:
    """A feature the model's engine lacks is a 400 naming the field that asked for it."""
    caps, name = runtime.engine.capabilities, runtime.name
    needs = ((asked.json is not None, "grammars", "response_format", "constrained (JSON) output"),
             (asked.grammar is not None, "grammars", "grammar", "grammars"),
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
        meta["constraint_param"] = ("tools" if tools.constraint is not None
                                    else "grammar" if sampling.grammar else "response_format")
    return meta


def _tenant(key, req) -> str | None:
    """Whom a request is for: its API key's name under a key policy, else the body's ``user``."""
    if key is not None:
        return f"key:{key.name}"
    return f"user:{req.user}" if req.user else None


def _echo_text(runtime, tokens: list[int]) -> str:
    """The prompt as text, from its tokens (special tokens render as nothing)."""
    token_bytes = runtime.engine.token_bytes
    return b"".join(bytes(token_bytes(t)) for t in tokens).decode("utf-8", errors="replace")
