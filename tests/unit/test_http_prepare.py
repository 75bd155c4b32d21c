"""plugins/http/prepare/preparer.py: a typed request and its headers become one frozen Prepared value,
with a fake daemon (a whitespace tokenizer, a ChatML template); no model, no server."""

from __future__ import annotations

import attrs
import pytest

from superfluid.core.adapters import AdapterTable
from superfluid.core.errors import ContextLengthExceeded, InvalidRequest
from superfluid.plugins.http.openai.chat_protocol import ChatCompletionRequest
from superfluid.plugins.http.openai.protocol import CompletionRequest, InfillRequest
from superfluid.plugins.http.prepare.preparer import Preparer, max_tokens
from superfluid.plugins.http.prepare.tool_format import CLOSE
from superfluid.plugins.http.typed import parse

from .fakes import format_registry

KINDS = {"chat": ChatCompletionRequest, "completion": CompletionRequest, "infill": InfillRequest}

CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] "
          "+ '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
          "{% endif %}")
CONFIG = {"http-qos-header": True, "http-default-qos": "agent", "http-allow-batch-invariant": False,
          "completion-rate": "10/s", "completion-burst": 20, "completion-deadline-ms": 0, "fim-model": None}
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


class FakeEngine:
    def __init__(self, grammars: bool):
        self.info = attrs.make_class("Info", {})()
        self.info.chat_template, self.info.bos_token, self.info.eos_token = CHATML, "", ""
        self.info.add_bos, self.info.n_vocab = False, 1000
        self.capabilities = attrs.make_class("Caps", {})()
        self.capabilities.grammars = grammars
        self.texts: list[str] = []

    def tokenize(self, text, add_special, parse_special):
        self.texts.append(text)
        return [len(word) % 1000 for word in text.split()]


class FakeRuntime:
    def __init__(self, grammars: bool, ctx: int):
        self.name = "m"
        self.engine = FakeEngine(grammars)
        self.loop = attrs.make_class("Loop", {})()
        self.loop.settings = attrs.make_class("Settings", {})()
        self.loop.settings.context_length = ctx
        self.loop.adapters = AdapterTable(self.name)  # no LoRA adapters loaded


class FakeDaemon:
    def __init__(self, grammars=True, ctx=64):
        self.runtime = FakeRuntime(grammars, ctx)
        self.formats = format_registry()

    def get(self, name):
        return self.runtime


class FakeBridge:
    def __init__(self, lanes):
        self.lanes = lanes

    def __call__(self, event):
        pass

    def lane(self, index):
        return self if index == 0 else (lambda event: None)


class FakeHttp:
    def __init__(self, headers=None):
        self.headers = headers or {}
        self.remote = "127.0.0.1"


def prepare(body, *, grammars=True, ctx=64, headers=None, qos=None, kind="chat"):
    daemon = FakeDaemon(grammars, ctx)
    sinks = []

    def make_sink(stream, lanes):
        sinks.append(stream)
        return FakeBridge(lanes)

    prep = Preparer(daemon, CONFIG).prepare(FakeHttp(headers), parse(KINDS[kind], body), arrived=1.0,
                                            make_sink=make_sink, qos=qos)
    return prep, daemon.runtime.engine, sinks


ASK = [{"role": "user", "content": "hi there"}]


def test_a_chat_becomes_one_frozen_value():
    prep, engine, sinks = prepare({"messages": ASK, "stream": True, "stream_options": {"include_usage": True}})
    assert (prep.kind, prep.stream, prep.include_usage, sinks) == ("chat", True, True, [True])
    assert prep.bridge is prep.request.sink and not prep.tools.active
    req = prep.request
    assert req.meta == {"chat": True, "fim": False} and req.streamed and req.arrived == 1.0
    assert req.max_tokens == 64 - len(req.prompt_tokens)  # chat: the rest of the context
    assert req.qos == "agent" and req.sampling.json_schema is None
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        prep.stream = False


def test_a_forced_call_carries_its_schema_where_the_engine_can_constrain():
    body = {"messages": ASK, "tools": [TOOL], "tool_choice": "required"}
    prep, engine, _ = prepare(body, grammars=True)
    constraint = prep.request.sampling.json_schema
    assert constraint is prep.tools.constraint and constraint.tail == "}\n" + CLOSE
    assert [c.schema for c in constraint.choices] == [TOOL["function"]["parameters"]]
    assert engine.texts[-1].endswith(prep.tools.prefill) and prep.tools.prefill.endswith('"arguments":')
    assert prep.request.stop == () and prep.request.sampling.constrained  # the grammar ends the call

    prep, engine, _ = prepare(body, grammars=False)  # forced by the pre-fill alone
    assert prep.request.sampling.json_schema is None and prep.tools.prefill.endswith('"arguments": {')


def test_the_prompt_against_the_context_is_the_schedulers_check():
    # A prompt that alone fills the context is left to the scheduler's submit (its error names
    # the prompt), whatever max_tokens says; a completion too long for what is left is a 400 here.
    prep, _, _ = prepare({"messages": [{"role": "user", "content": "w " * 100}], "max_tokens": 4}, ctx=16)
    assert len(prep.request.prompt_tokens) >= 16 and prep.request.max_tokens == 1
    with pytest.raises(ContextLengthExceeded) as info:
        prepare({"prompt": "a b c", "max_tokens": 100}, ctx=16, kind="completion")
    assert info.value.param == "max_tokens"
    assert max_tokens(None, "max_tokens", False, 3, 64) == 16 and max_tokens(None, "max_tokens", True, 3, 64) == 61


def test_a_ceiling_is_cut_to_the_context_and_the_keys_cap_instead_of_refused():
    # Anthropic's max_tokens (Claude Code asks 32000 of any model): cut, never a 400
    assert max_tokens(32000, "max_tokens", True, 100, 8192, ceiling=True) == 8092
    assert max_tokens(32000, "max_tokens", True, 100, 8192, cap=256, ceiling=True) == 256
    with pytest.raises(InvalidRequest):  # OpenAI's: asking over the key's cap is a 400
        max_tokens(32000, "max_tokens", True, 100, 8192, cap=256)
    with pytest.raises(ContextLengthExceeded):
        max_tokens(32000, "max_tokens", True, 100, 8192)


def test_the_qos_header_is_validated_also_when_a_session_overrides_it():
    prep, _, _ = prepare({"messages": ASK}, headers={"x-superfluid-qos": "interactive"})
    assert prep.request.qos == "interactive"
    assert prepare({"messages": ASK}, qos="background")[0].request.qos == "background"
    with pytest.raises(InvalidRequest):
        prepare({"messages": ASK}, headers={"x-superfluid-qos": "urgent"}, qos="background")


def test_prompt_length_for_session_windows():
    preparer = Preparer(FakeDaemon(), CONFIG)
    short, tools = parse(ChatCompletionRequest, {"messages": ASK}), parse(ChatCompletionRequest, {"messages": ASK, "tools": [TOOL]})
    assert preparer.chat_prompt_length(short) == len(preparer.chat_prompt(short)[1])
    assert preparer.chat_prompt_length(tools) > preparer.chat_prompt_length(short)  # the tools are in the prompt


# ---- the rest of the OpenAI fields ----------------------------------------------------------

def full(body, kind="chat", **caps):
    """prepare() against an engine that serves logprobs, logit_bias and grammars (unless ``caps``
    says otherwise), with a token_bytes for echo."""
    daemon = FakeDaemon(True, 64)
    engine = daemon.runtime.engine
    for name in ("logprobs", "logit_bias", "grammars"):
        setattr(engine.capabilities, name, caps.get(name, True))
    engine.capabilities.generates = caps.get("generates", True)
    engine.token_bytes = lambda t: b"<%d>" % t
    return Preparer(daemon, CONFIG).prepare(FakeHttp(), parse(KINDS[kind], body), arrived=1.0,
                                            make_sink=lambda stream, lanes: FakeBridge(lanes))


def test_n_choices_are_lanes_with_the_same_prompt_and_their_own_seeds():
    prep = full({"messages": ASK, "n": 3, "seed": 7, "temperature": 0.8})
    reqs = prep.requests
    assert len(reqs) == 3 and prep.request is reqs[0] and reqs[0].sink is prep.bridge
    assert len({r.id for r in reqs}) == 3 and all(r.prompt_tokens == reqs[0].prompt_tokens for r in reqs)
    assert [r.sampling.seed for r in reqs] == [7, 8, 9] and [r.meta.get("choice") for r in reqs] == [None, 1, 2]
    assert all(r.sampling.temperature == 0.8 for r in reqs)
    assert [r.sampling.seed for r in full({"messages": ASK, "n": 2}).requests] == [None, None]
    with pytest.raises(InvalidRequest) as info:
        full({"input_prefix": "a", "input_suffix": "b", "n": 2}, kind="infill")
    assert info.value.param == "n"


def test_logprobs_bias_and_formats_reach_the_sampling_params():
    prep = full({"messages": ASK, "logprobs": True, "top_logprobs": 3, "logit_bias": {"5": -100},
                 "response_format": {"type": "json_object"}})
    sampling = prep.request.sampling
    assert (prep.logprobs, sampling.logprobs, sampling.logit_bias) == (3, 3, ((5, -100.0),))
    assert sampling.json_schema.choices[0].schema == {"type": "object"} and prep.request.prompt_logprobs is None
    assert full({"prompt": "a b", "logprobs": 2}, kind="completion").request.sampling.logprobs == 2


def test_a_feature_the_engine_lacks_is_a_400_naming_the_field():
    cases = [({"messages": ASK, "logprobs": True}, {"logprobs": False}, "logprobs", "unsupported_value"),
             ({"messages": ASK, "logit_bias": {"1": 1}}, {"logit_bias": False}, "logit_bias", "unsupported_value"),
             ({"messages": ASK, "response_format": {"type": "json_object"}}, {"grammars": False}, "response_format",
              "unsupported_value")]
    for body, caps, param, code in cases:
        with pytest.raises(InvalidRequest) as info:
            full(body, **caps)
        assert (info.value.param, info.value.code) == (param, code)


def test_json_formats_and_forced_calls_do_not_mix():
    with pytest.raises(InvalidRequest) as info:
        full({"messages": ASK, "tools": [TOOL], "tool_choice": "required", "response_format": {"type": "json_object"}})
    assert info.value.param == "response_format"


def test_what_the_model_loop_refuses_on_submit_is_left_to_it():
    """A generation from an embedding-only model and a schema llguidance cannot enforce are
    ModelLoop.submit's 400s, for every front end (test_loop.py): prepare does not repeat them,
    and names the field a constraint came from for that 400."""
    assert full({"messages": ASK}, generates=False).request.meta["chat"]
    made_up = {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "string", "format": "made-up"}}}
    prep = full({"messages": ASK, "response_format": made_up})
    assert prep.request.meta["constraint_param"] == "response_format"
    prep = full({"messages": ASK, "tools": [{"type": "function", "function": {"name": "pay", "parameters": {
        "type": "object", "properties": {"card": {"type": "string", "format": "credit-card"}}}}}],
        "tool_choice": "required"})
    assert prep.request.meta["constraint_param"] == "tools"


def test_echo_scores_the_prompt_and_max_tokens_0_only_scores():
    prep = full({"prompt": "a bb", "echo": True, "logprobs": 1, "max_tokens": 0, "n": 2}, kind="completion")
    assert prep.echo == "<1><2>" and prep.score_only and prep.request.max_tokens == 1
    assert prep.request.prompt_logprobs == 1 and prep.requests[1].prompt_logprobs is None  # scored once
    prep = full({"prompt": "a", "echo": True}, kind="completion")
    assert prep.echo == "<1>" and not prep.score_only and prep.request.prompt_logprobs is None
    for body, param in (({"prompt": "a", "max_tokens": 0}, "max_tokens"),
                        ({"prompt": "a", "suffix": "b", "echo": True}, "echo")):
        with pytest.raises(InvalidRequest) as info:
            full(body, kind="completion")
        assert info.value.param == param


def test_how_the_prompt_ends_follows_the_request():
    # transformers' add_generation_prompt / continue_final_message, as vLLM takes them in a chat
    partial = ASK + [{"role": "assistant", "content": "Hello, my name"}]
    _, engine, _ = prepare({"messages": partial, "continue_final_message": True})
    assert engine.texts[-1].endswith("<|im_start|>assistant\nHello, my name")
    _, engine, _ = prepare({"messages": ASK, "add_generation_prompt": False})
    assert engine.texts[-1].endswith("hi there<|im_end|>\n")
    _, engine, _ = prepare({"messages": ASK})
    assert engine.texts[-1].endswith("<|im_start|>assistant\n")
    with pytest.raises(InvalidRequest) as info:
        prepare({"messages": partial, "continue_final_message": True, "add_generation_prompt": True})
    assert info.value.param == "continue_final_message"


def test_documents_reach_a_template_that_renders_them():
    rag = ("{% for d in documents %}[{{ d.title }}] {{ d.text }}\n{% endfor %}"
           "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}")
    daemon = FakeDaemon()
    daemon.runtime.engine.info.chat_template = rag
    req = parse(ChatCompletionRequest, {"messages": ASK, "documents": [{"title": "Paris", "text": "21C, sunny"}]})
    assert Preparer(daemon, CONFIG).chat_text(req) == "[Paris] 21C, sunny\nuser: hi there\n"
    smuggled = parse(ChatCompletionRequest, {"messages": ASK, "chat_template_kwargs": {"documents": []}})
    with pytest.raises(InvalidRequest) as info:  # the server sets documents; kwargs may not
        Preparer(daemon, CONFIG).chat_text(smuggled)
    assert info.value.param == "chat_template_kwargs"


def test_a_forced_call_closes_the_span_the_generation_prompt_opens():
    from superfluid.core.formats.setup import chat_setup

    from .fakes import format_registry

    opens = ("{% if tools %}{% for t in tools %}<tool_call>{{ t | tojson }}</tool_call>{% endfor %}{% endif %}"
             "{% if false %}</think>{% endif %}"
             + CHATML.replace("'<|im_start|>assistant\n'", "'<|im_start|>assistant\n<think>\n'"))
    daemon = FakeDaemon()
    daemon.runtime.engine.info.chat_template = opens
    daemon.runtime.chat = chat_setup(opens, format_registry())
    assert daemon.runtime.chat.detected.reasoning.name == "think"
    req = parse(ChatCompletionRequest, {"messages": ASK, "tools": [TOOL], "tool_choice": "required"})
    text = Preparer(daemon, CONFIG).chat_text(req)
    assert text.endswith('<|im_start|>assistant\n<think>\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments":')
    prep = Preparer(daemon, CONFIG).prepare(FakeHttp(), req, arrived=1.0, make_sink=lambda s, n: FakeBridge(n))
    assert prep.reader.inside and prep.reader.read(' {"city": "Paris"}}\n</tool_call>').calls[0].name == "get_weather"
