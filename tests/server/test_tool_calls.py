"""Tool calls: parsing and rendering units, then the real server and SmolLM2 through the openai
client (its plain ChatML template renders no tools, so these run the injected Hermes format)."""

from __future__ import annotations

import json
import random

import pytest

from superfluid.core.chat import template_caps
from superfluid.plugins.http.openai.chat_protocol import ChatCompletionRequest
from superfluid.core.formats.stream import StreamReader
from superfluid.plugins.http.prepare import reply_read, tool_format, tool_plan, tool_render
from superfluid.plugins.http.typed import parse

from ..unit.fakes import format_registry
from .test_bad_input import body, post

HERMES = format_registry().tool_format("hermes")

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Get the current time in a timezone",
    "parameters": {"type": "object", "properties": {"timezone": {"type": "string"}}}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}

CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] "
          "+ '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
          "{% endif %}")
# A Qwen2.5-like template: renders tools, tool_calls (arguments through tojson) and tool results.
NATIVE = ("{% if tools %}<|im_start|>system\n<tools>{% for t in tools %}\n{{ t | tojson }}{% endfor %}"
          "\n</tools><|im_end|>\n{% endif %}{% for m in messages %}{% if m.tool_calls %}"
          "<|im_start|>assistant\n{% for c in m.tool_calls %}<tool_call>\n{\"name\": \"{{ c.function.name }}\", "
          "\"arguments\": {{ c.function.arguments | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n"
          "{% elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response>"
          "<|im_end|>\n{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def plan_of(fields: dict, grammars: bool = False):
    """The tool plan of a chat request holding ``fields``."""
    req = parse(ChatCompletionRequest, {"messages": [{"role": "user", "content": "hi"}], **fields})
    return tool_plan.plan(req, HERMES, grammars=grammars)


def read(text: str, finish: str, tools):
    """A reply read as the server reads it (Hermes, the tools of ``tools``), in OpenAI's terms."""
    return reply_read.parsed(reply_read.reader(tools).read(text), finish)


def plan(**kw):
    return plan_of({"tools": [WEATHER, TIME], **kw})


# ---- units ----------------------------------------------------------------------------------

def test_template_caps_are_probed():
    assert template_caps(CHATML) == (False, False, True, False, False)
    assert template_caps(NATIVE) == (True, True, True, True, False)


def test_parse_tagged_calls_and_text_around():
    text = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n' \
           '<tool_call>{"name": "get_time", "parameters": {"timezone": "CET"}}</tool_call>'
    got = read(text, "stop", plan())
    assert got.content == "Let me check." and got.finish_reason == "tool_calls"
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got.calls] == [
        ("get_weather", {"city": "Paris"}), ("get_time", {"timezone": "CET"})]
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in got.calls)
    assert len(read(text, "stop", plan(parallel_tool_calls=False)).calls) == 1


def test_parse_bare_json_and_unclosed_call():
    got = read('[{"name": "get_time", "arguments": "{\\"timezone\\": \\"UTC\\"}"}]', "stop", plan())
    assert got.content is None and got.calls[0]["function"]["arguments"] == '{"timezone": "UTC"}'
    got = read('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}', "stop", plan())
    assert got.calls and got.finish_reason == "tool_calls"


@pytest.mark.parametrize("text", [
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": ',  # truncated
    '<tool_call>\n{"name": "launch_missiles", "arguments": {}}</tool_call>',  # not a declared tool
    '<tool_call>\n{"name": "get_weather", "arguments": "Paris"}</tool_call>',  # arguments not an object
    '{"name": "Paris"}', 'Plain text answer.'])
def test_unparseable_calls_are_content(text):
    got = read(text, "length", plan())
    assert (got.content, got.calls, got.finish_reason) == (text, [], "length")


@pytest.mark.parametrize("text", [
    "Sure.\n<tool_call>\n{\"name\": \"get_time\", \"arguments\": {}}\n</tool_call>\nDone.",
    "  <tool_call>{\"name\": \"get_time\"}</tool_call>", "No <tool calls> here <tool_",
    "<tool_call>{\"name\": \"nope\"}</tool_call> tail", "\n[1, 2]", "{\"name\": \"get_time\"}"])
def test_stream_parser_assembles_to_parse(text):
    tools = plan()
    rng = random.Random(len(text))
    for _ in range(20):
        stream, sent, i = StreamReader(reply_read.reader(tools)), [], 0
        while i < len(text):
            n = rng.randint(1, 5)
            sent.append(stream.feed(text[i:i + n]).content)
            i += n
        rest, whole = stream.finish()
        parsed = reply_read.parsed(whole, "stop")
        assert "".join(sent) + rest.content == (parsed.content or "")
        assert parsed.content == read(text, "stop", tools).content


def test_history_renders_as_text_for_a_template_without_tools():
    history = ASK + [
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21C, sunny"}]
    history = parse(ChatCompletionRequest, {"messages": history}).conversation
    text = tool_render.render_prompt(CHATML, history, plan(), add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\n# Tools\n") and '"name": "get_time"' in text
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
            '</tool_call><|im_end|>\n<|im_start|>tool\n<tool_response>\n21C, sunny\n</tool_response>') in text
    forced = tool_render.render_prompt(CHATML, history, plan(tool_choice=NAMED), add_generation_prompt=True)
    assert forced == text + '<tool_call>\n{"name": "get_weather", "arguments": {'
    native = tool_render.render_prompt(NATIVE, history, plan(), add_generation_prompt=True)
    assert native.startswith("<|im_start|>system\n<tools>") and "# Tools" not in native
    assert '"arguments": {"city": "Paris"}}' in native  # the template wants objects: it got one


# ---- the real server ------------------------------------------------------------------------

def ask(client, **kw):
    args = dict(model="smollm2", messages=ASK, tools=[WEATHER, TIME], temperature=0, max_tokens=64)
    return client.chat.completions.create(**(args | kw))


def test_named_tool_choice_returns_that_call(client):
    r = ask(client, tool_choice=NAMED, extra_body={"cache_prompt": False})
    msg = r.choices[0].message
    assert r.choices[0].finish_reason in ("tool_calls", "length")
    assert len(msg.tool_calls) == 1 and msg.content is None
    call = msg.tool_calls[0]
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    assert isinstance(json.loads(call.function.arguments), dict)


def test_required_with_one_tool_forces_it(client):
    r = ask(client, tools=[TIME], tool_choice="required", extra_body={"cache_prompt": False},
            messages=[{"role": "user", "content": "What time is it in Tokyo?"}])
    assert r.choices[0].message.tool_calls[0].function.name == "get_time"


def test_none_offers_no_tools(client):
    plain = client.chat.completions.create(model="smollm2", messages=ASK, temperature=0, max_tokens=16)
    r = ask(client, tool_choice="none", max_tokens=16)
    assert r.choices[0].message.tool_calls is None
    assert r.choices[0].message.content == plain.choices[0].message.content
    assert r.usage.prompt_tokens == plain.usage.prompt_tokens  # no tool descriptions in the prompt


def test_tool_session_reuses_the_cached_prefix(client):
    """An agent loop: each turn sends back the calls and their results; all of the previous turn's
    prompt comes from the prefix cache (all but the last token, which is re-evaluated)."""
    messages, previous, called = list(ASK), None, 0
    for turn in range(4):
        r = ask(client, messages=messages, tool_choice=NAMED, max_tokens=96,
                extra_body={"cache_prompt": turn > 0})  # turn 0 prefilled fresh: a known reply
        choice = r.choices[0]
        if previous is not None:
            assert r.usage.prompt_tokens_details.cached_tokens >= previous.usage.prompt_tokens - 1
        if choice.message.tool_calls:
            call = choice.message.tool_calls[0].model_dump()
            called += 1
        else:  # 135M params can ramble past max_tokens inside the arguments: then it is raw text
            assert choice.finish_reason == "length" and choice.message.content.startswith("<tool_call>")
            call = {"id": f"call_{turn}", "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
        messages += [{"role": "assistant", "content": None, "tool_calls": [call]},
                     {"role": "tool", "tool_call_id": call["id"], "content": json.dumps({"temp_c": 20 + turn})},
                     {"role": "user", "content": "And tomorrow?"}]
        previous = r
    assert called >= 1
    final = ask(client, messages=messages, tool_choice="auto", max_tokens=16)
    assert final.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert final.usage.prompt_tokens_details.cached_tokens >= previous.usage.prompt_tokens - 1


@pytest.mark.parametrize("choice", [NAMED, "auto"])
def test_stream_assembles_to_the_whole_reply(client, choice):
    kw = dict(tool_choice=choice, extra_body={"cache_prompt": False})  # same KV, same greedy tokens
    whole = ask(client, **kw).choices[0]
    content, calls, finish = "", {}, None
    for chunk in ask(client, stream=True, **kw):
        for c in chunk.choices:
            content += c.delta.content or ""
            for d in c.delta.tool_calls or []:
                slot = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
                slot["id"] = d.id or slot["id"]
                slot["name"] += d.function.name or ""
                slot["arguments"] += d.function.arguments or ""
            finish = c.finish_reason or finish
    assert (content or None) == whole.message.content
    assert finish == whole.finish_reason
    expect = [(c.function.name, c.function.arguments) for c in whole.message.tool_calls or []]
    assert [(c["name"], c["arguments"]) for _, c in sorted(calls.items())] == expect
    assert all(c["id"].startswith("call_") for c in calls.values())


CHAT = {"model": "smollm2", "messages": ASK, "max_tokens": 4}
BAD = [
    ("tools not a list", {"tools": {"a": 1}}, "tools"),
    ("tool not a function", {"tools": [{"type": "retrieval"}]}, "tools[0].type"),
    ("tool without function", {"tools": [{"type": "function"}]}, "tools[0].function"),
    ("bad tool name", {"tools": [{"type": "function", "function": {"name": "get weather!"}}]},
     "tools[0].function.name"),
    ("duplicate tool", {"tools": [WEATHER, WEATHER]}, "tools[1].function.name"),
    ("parameters not an object", {"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]},
     "tools[0].function.parameters"),
    ("parameters not an object schema", {"tools": [WEATHER, {"type": "function", "function": {
        "name": "f", "parameters": {"type": "string"}}}]}, "tools[1].function.parameters"),
    ("parameters with bad properties", {"tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": [1]}}}], "tool_choice": "required"},
     "tools[0].function.parameters"),
    ("parameters with bad required", {"tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "required": "a"}}}]}, "tools[0].function.parameters"),
    ("unknown tool_choice", {"tools": [WEATHER], "tool_choice": "always"}, "tool_choice"),
    ("tool_choice names an undeclared tool", {"tools": [WEATHER], "tool_choice":
                                               {"type": "function", "function": {"name": "get_time"}}}, "tool_choice"),
    ("tool_choice malformed", {"tools": [WEATHER], "tool_choice": {"type": "function"}}, "tool_choice.function"),
    ("required without tools", {"tool_choice": "required"}, "tool_choice"),
    ("parallel_tool_calls not a bool", {"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ("tool message without tool_call_id", {"messages": ASK + [{"role": "tool", "content": "x"}]},
     "messages[1].tool_call_id"),
    ("tool_calls not a list", {"messages": ASK + [{"role": "assistant", "content": None, "tool_calls": 5}]},
     "messages[1].tool_calls"),
    ("tool call without id", {"messages": ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": "{}"}}]}]}, "messages[1].tool_calls[0].id"),
]


@pytest.mark.parametrize("name,extra,param", BAD, ids=[b[0] for b in BAD])
def test_bad_tool_input_names_the_field(server, name, extra, param):
    status, got = post(server, "/v1/chat/completions", body({**CHAT, **extra}))
    assert status == 400, got
    assert got["error"]["param"] == param
    assert got["error"]["message"] and got["error"]["code"]


# ---- grammar-constrained forcing ----------------------------------------------------------------

FORECAST = {"type": "function", "function": {
    "name": "get_forecast", "description": "Get the weather forecast for a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["city", "days"]}}}
FORCE_FORECAST = {"type": "function", "function": {"name": "get_forecast"}}


def valid_forecast(args: dict) -> bool:
    """``args`` validates against FORECAST's schema."""
    return (isinstance(args, dict) and set(args) <= {"city", "days", "unit"}
            and isinstance(args.get("city"), str) and type(args.get("days")) is int
            and args.get("unit", "celsius") in ("celsius", "fahrenheit"))


@pytest.fixture(scope="module")
def vocab(model_path):
    llama_cpp = pytest.importorskip("llama_cpp")
    llama_cpp.llama_backend_init()
    params = llama_cpp.llama_model_default_params()
    params.vocab_only = True
    model = llama_cpp.llama_model_load_from_file(model_path.encode(), params)
    yield llama_cpp.llama_model_get_vocab(model)
    llama_cpp.llama_model_free(model)


def grammar(tools):
    """What a forced call's rest is held to: the plan's JSON constraint, as sampling carries it."""
    from superfluid.core.request import SamplingParams

    return SamplingParams(json_schema=tools.constraint)


def grammar_takes(vocab, sampling, text: str) -> bool:
    """Whether the constraint (llguidance's token masks, as the engines apply them) lets ``text``
    through and then lets the generation end."""
    import llama_cpp

    from superfluid.plugins.llamacpp.constraints import constrainer

    from ..constraint_walk import takes

    return takes(constrainer(vocab, llama_cpp.llama_vocab_n_tokens(vocab)), vocab, sampling, text)


def test_forced_call_grammar_follows_the_schema(vocab):
    tools = plan_of({"tools": [FORECAST, TIME], "tool_choice": FORCE_FORECAST}, grammars=True)
    assert tools.prefill == '<tool_call>\n{"name": "get_forecast", "arguments":'
    assert plan_of({"tools": [FORECAST], "tool_choice": FORCE_FORECAST}).constraint is None  # not asked: none
    good = ' {"city": "Paris", "days": 3}}\n</tool_call>'
    assert grammar_takes(vocab, grammar(tools), good)
    assert grammar_takes(vocab, grammar(tools), ' {"city": "Oslo", "days": -2, "unit": "fahrenheit"}}\n</tool_call>')
    for bad in [' {"city": "Paris", "days": "3"}}\n</tool_call>',   # days not an integer
                ' {"days": 3}}\n</tool_call>',                      # city missing
                ' {"city": "Paris", "days": 3, "unit": "kelvin"}}\n</tool_call>',
                ' {"city": "Pa\nris", "days": 3}}\n</tool_call>',   # a raw control character
                ' {"city": "Paris", "days": 3}}\n</tool_call>\n<tool_call>']:  # a second call
        assert not grammar_takes(vocab, grammar(tools), bad), bad
    parsed = read(good.removesuffix(tool_format.CLOSE), "stop", tools)  # the reader adds the pre-fill
    assert json.loads(parsed.calls[0]["function"]["arguments"]) == {"city": "Paris", "days": 3}


def test_required_grammar_alternates_the_names(vocab):
    tools = plan_of({"tools": [FORECAST, TIME], "tool_choice": "required"}, grammars=True)
    assert tools.choice == "required" and tools.prefill == '<tool_call>\n{"name":'
    assert grammar_takes(vocab, grammar(tools), ' "get_time", "arguments": {"timezone": "CET"}}\n</tool_call>')
    assert grammar_takes(vocab, grammar(tools), ' "get_forecast", "arguments": {"city": "Rome", "days": 1}}\n</tool_call>')
    assert not grammar_takes(vocab, grammar(tools), ' "get_forecast", "arguments": {"timezone": "CET"}}\n</tool_call>')
    assert not grammar_takes(vocab, grammar(tools), ' "launch", "arguments": {}}\n</tool_call>')


def test_schema_beyond_the_library_is_refused_not_sampled_freely(vocab):
    from superfluid.core.constrain import UnsupportedConstraint, check

    odd = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"$ref": "https://example.com/schema.json"}}}}}
    tools = plan_of({"tools": [odd], "tool_choice": "required"}, grammars=True)
    assert tools.choice == "function"
    with pytest.raises(UnsupportedConstraint, match="example.com"):
        check(grammar(tools))


def test_a_tool_without_parameters_takes_any_object(vocab):
    bare = {"type": "function", "function": {"name": "g"}}  # no parameters: any object
    assert grammar_takes(vocab, grammar(plan_of({"tools": [bare], "tool_choice": "required"}, grammars=True)),
                         ' {}}\n</tool_call>')


PROMPTS = ["What is the weather in Paris?", "Forecast for Tokyo, the next 3 days please.",
           "Will it rain in Oslo this week?", "hello"]


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 0.8, "seed": 42}],
                         ids=["greedy", "sampled"])
def test_forced_call_is_valid_on_the_server(client, sampling):
    for prompt in PROMPTS:
        r = ask(client, messages=[{"role": "user", "content": prompt}], tools=[FORECAST, TIME],
                tool_choice=FORCE_FORECAST, max_tokens=64, **sampling)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls", (prompt, choice)
        assert choice.message.content is None and len(choice.message.tool_calls) == 1
        call = choice.message.tool_calls[0].function
        assert call.name == "get_forecast" and valid_forecast(json.loads(call.arguments)), (prompt, call)


def test_required_with_several_tools_is_a_valid_call(client):
    for prompt in PROMPTS[:2] + ["What time is it in Tokyo?"]:
        r = ask(client, messages=[{"role": "user", "content": prompt}], tools=[FORECAST, TIME],
                tool_choice="required", max_tokens=64)
        calls = r.choices[0].message.tool_calls
        assert r.choices[0].finish_reason == "tool_calls" and len(calls) == 1, r.choices[0]
        args = json.loads(calls[0].function.arguments)
        assert valid_forecast(args) if calls[0].function.name == "get_forecast" else isinstance(args, dict)


def test_closing_tag_inside_an_argument_does_not_cut_the_call(client):
    """A forced call's grammar ends the call with its closing tag, so no stop string does: the
    tag written inside a string value (seen in a soak, sampled, about 1 call in 100) stays text."""
    tagged = {"type": "function", "function": {"name": "note", "parameters": {
        "type": "object", "properties": {"text": {"type": "string", "enum": ["a </tool_call> b"]}},
        "required": ["text"]}}}
    plan = plan_of({"tools": [tagged], "tool_choice": "required"}, grammars=True)
    assert plan.constraint is not None and plan.stop == ()
    r = ask(client, messages=[{"role": "user", "content": "Take a note."}], tools=[tagged],
            tool_choice="required", max_tokens=64)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert json.loads(choice.message.tool_calls[0].function.arguments) == {"text": "a </tool_call> b"}


STORY = {"type": "function", "function": {
    "name": "write_story", "description": "Save a story",
    "parameters": {"type": "object", "properties": {"title": {"type": "string"}, "pages": {"type": "integer"},
                                                    "story": {"type": "string", "minLength": 100, "maxLength": 200}},
                   "required": ["title", "pages", "story"]}}}


@pytest.mark.parametrize("park", [True, False], ids=["park", "no-park"])
def test_preempted_grammar_lane_resumes_its_call(start_server, park):
    """A forced call preempted mid-arguments (one lane, an interactive request) resumes with its
    grammar where it left off: the same valid call as undisturbed (parked KV, or replayed)."""
    import concurrent.futures as cf

    from .test_qos_server import metric, wait_for
    from .test_qos_server import post as qos_post

    srv = start_server("--max-batch", "1", *(["--park"] if park else ["--no-park"]))
    call = {"model": "smollm2", "messages": [{"role": "user", "content": "Write a story about a lighthouse."}],
            "tools": [STORY], "tool_choice": "required", "temperature": 0, "max_tokens": 120,
            "cache_prompt": False}  # both prefill the whole prompt: the same KV, the same greedy tokens

    def run() -> dict:
        status, got, _ = qos_post(srv.base, "/v1/chat/completions", call, timeout=300)
        assert status == 200, got
        return got["choices"][0]

    alone = run()
    with cf.ThreadPoolExecutor(1) as pool:
        agent = pool.submit(run)

        def decoding():
            slots = srv.get_json("/slots")["models"]["smollm2"]["slots"]
            return any(s["state"] == "decoding" and s["generated_tokens"] > 12 for s in slots)
        wait_for(decoding, what="the forced call decoding")
        status, chat, _ = qos_post(srv.base, "/v1/chat/completions", {
            "model": "smollm2", "messages": [{"role": "user", "content": "Hi!"}], "max_tokens": 4},
            {"x-superfluid-qos": "interactive"})
        assert status == 200, chat
        resumed = agent.result(timeout=300)
    assert metric(srv, "superfluid_preemptions_total") >= 1
    assert resumed["finish_reason"] == "tool_calls", resumed
    args = json.loads(resumed["message"]["tool_calls"][0]["function"]["arguments"])
    assert 100 <= len(args["story"]) <= 200 and type(args["pages"]) is int
    assert resumed["message"]["tool_calls"][0]["function"]["arguments"] == \
        alone["message"]["tool_calls"][0]["function"]["arguments"]
