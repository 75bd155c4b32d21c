"""The official ``openai`` SDK (sync and async), as agents use it, against real servers: SmolLM2 on
llama.cpp and a tiny random-weight model on the MLX engine.

The models write poor (SmolLM2) or random (tiny) text, so every check is on protocol and
structure: usage in the last stream chunk and equal to the non-streamed request's, a parsed
pydantic object from ``.parse()``, a forced tool call whose arguments validate against the
tool's schema, logprobs consistent with greedy decoding, ``n`` choices, embedding shapes."""

from __future__ import annotations

import asyncio
import json
import math

import pytest

openai = pytest.importorskip("openai")
from pydantic import BaseModel, ConfigDict, Field  # noqa: E402

from ..tinygguf import write_tiny_llama  # noqa: E402


class City(BaseModel):
    """A small, bounded schema: a short string and a boolean fit in 48 tokens."""
    model_config = ConfigDict(extra="forbid")
    name: str = Field(max_length=24)
    is_capital: bool


class Weather(BaseModel):
    """The forced tool's arguments, validated strictly (no extra keys)."""
    model_config = ConfigDict(extra="forbid")
    city: str = Field(max_length=24)


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24}},
                   "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Get the current time in a timezone",
    "parameters": {"type": "object", "properties": {"timezone": {"type": "string", "enum": ["UTC", "CET", "PST"]}},
                   "required": ["timezone"], "additionalProperties": False}}}
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]
ASK_CITY = [{"role": "system", "content": "Answer in JSON."},
            {"role": "user", "content": "Name a city in France and say whether it is the capital."}]
HI = [{"role": "user", "content": "Say hello in three words."}]

ENGINES = {
    # engine: (model name, embedding width: the model's n_embd, max_tokens for a JSON reply).
    # The tiny model's vocabulary spells JSON keys a character at a time (47 tokens for a City),
    # and its tokens cost next to nothing, so it gets more room than SmolLM2's 48.
    "llamacpp": ("smollm2", 576, 48),
    "mlx": ("tiny", 64, 160),
}


class Srv:
    def __init__(self, proc, engine: str):
        self.proc, self.engine = proc, engine
        self.model, self.n_embd, self.json_tokens = ENGINES[engine]
        self.base = proc.base

    def sync(self):
        return openai.OpenAI(base_url=self.base + "/v1", api_key="unused", timeout=120, max_retries=0)

    def aio(self):
        return openai.AsyncOpenAI(base_url=self.base + "/v1", api_key="unused", timeout=120, max_retries=0)


@pytest.fixture(scope="module", params=list(ENGINES))
def srv(request, start_server, tmp_path_factory):
    if request.param == "llamacpp":
        return Srv(start_server("--max-batch", "4", shared=True), "llamacpp")  # chats only: shared
    pytest.importorskip("mlx.core", reason="mlx is not installed (pip install 'superfluid[mlx]')")
    pytest.importorskip("mlx_lm", reason="mlx-lm is not installed (pip install 'superfluid[mlx]')")
    tiny = write_tiny_llama(tmp_path_factory.mktemp("clients-mlx") / "tiny.gguf", quant="Q8_0",
                            n_layer=2, n_embd=64, n_ff=128)
    return Srv(start_server("--model", str(tiny), "--model-name", "tiny", "--engine", "mlx",
                            "--max-batch", "4"), "mlx")


def usage3(u):
    return (u.prompt_tokens, u.completion_tokens, u.total_tokens)


def check_weather_call(choice, name="get_weather"):
    assert choice.finish_reason == "tool_calls", choice
    calls = choice.message.tool_calls
    assert calls is not None and len(calls) == 1, choice.message
    call = calls[0]
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == name
    return call


# ---- sync ----------------------------------------------------------------------------------

def test_chat_create(srv):
    r = srv.sync().chat.completions.create(model=srv.model, messages=HI, max_tokens=12, temperature=0)
    assert r.object == "chat.completion" and r.model == srv.model and r.id
    assert len(r.choices) == 1
    c = r.choices[0]
    assert c.index == 0 and c.message.role == "assistant" and isinstance(c.message.content, str)
    assert c.finish_reason in ("stop", "length") and c.message.tool_calls is None
    u = r.usage
    assert u.prompt_tokens > 0 and 0 < u.completion_tokens <= 12
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens


def test_models_list_and_retrieve(srv):
    client = srv.sync()
    assert [m.id for m in client.models.list()] == [srv.model]
    m = client.models.retrieve(srv.model)
    assert m.id == srv.model and m.object == "model"


def test_stream_include_usage_last_chunk_matches(srv):
    client = srv.sync()
    kw = dict(model=srv.model, messages=HI, max_tokens=16, temperature=0)
    whole = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert len(chunks) >= 3
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(ch.object == "chat.completion.chunk" and ch.id == chunks[0].id for ch in chunks)
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert all(ch.usage is None for ch in chunks[:-1])
    assert usage3(last.usage) == usage3(whole.usage)
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks[:-1])
    assert text == whole.choices[0].message.content
    finishes = [ch.choices[0].finish_reason for ch in chunks[:-1] if ch.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason]


def test_stream_without_include_usage_has_none(srv):
    chunks = list(srv.sync().chat.completions.create(model=srv.model, messages=HI, max_tokens=4,
                                                     temperature=0, stream=True))
    assert chunks and all(ch.usage is None and len(ch.choices) == 1 for ch in chunks)


def test_tool_choice_named(srv):
    r = srv.sync().chat.completions.create(
        model=srv.model, messages=ASK_WEATHER, tools=[WEATHER, TIME], max_tokens=srv.json_tokens, temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    call = check_weather_call(r.choices[0])
    Weather.model_validate_json(call.function.arguments)


def test_tool_choice_required_two_tools(srv):
    r = srv.sync().chat.completions.create(
        model=srv.model, messages=ASK_WEATHER, tools=[WEATHER, TIME], max_tokens=srv.json_tokens, temperature=0,
        tool_choice="required")
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    fn = choice.message.tool_calls[0].function
    assert fn.name in ("get_weather", "get_time")
    args = json.loads(fn.arguments)
    if fn.name == "get_weather":
        Weather.model_validate(args)
    else:
        assert set(args) == {"timezone"} and args["timezone"] in ("UTC", "CET", "PST")


def test_tool_call_round_trip(srv):
    """The SDK's own objects go back as history: assistant tool_calls + a tool result."""
    client = srv.sync()
    first = client.chat.completions.create(
        model=srv.model, messages=ASK_WEATHER, tools=[WEATHER], max_tokens=srv.json_tokens, temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    call = check_weather_call(first.choices[0])
    history = [*ASK_WEATHER, first.choices[0].message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": '{"temp_c": 21}'}]
    second = client.chat.completions.create(model=srv.model, messages=history, tools=[WEATHER],
                                            tool_choice="none", max_tokens=8, temperature=0)
    assert second.choices[0].message.tool_calls is None
    assert isinstance(second.choices[0].message.content, str)
    # tool_choice "none" drops the tools from the prompt; the rendered call and result remain
    plain = client.chat.completions.create(model=srv.model, messages=ASK_WEATHER, max_tokens=1, temperature=0)
    assert second.usage.prompt_tokens > plain.usage.prompt_tokens + 10


def test_parse_pydantic_function_tool(srv):
    """``openai.pydantic_function_tool`` (a strict tool) and ``.parse()``'s parsed_arguments."""
    r = srv.sync().chat.completions.parse(
        model=srv.model, messages=ASK_CITY, tools=[openai.pydantic_function_tool(City)],
        tool_choice={"type": "function", "function": {"name": "City"}}, max_tokens=srv.json_tokens, temperature=0)
    call = check_weather_call(r.choices[0], name="City")
    assert isinstance(call.function.parsed_arguments, City)


def test_parse_response_format_pydantic(srv):
    r = srv.sync().chat.completions.parse(model=srv.model, messages=ASK_CITY, response_format=City,
                                          max_tokens=srv.json_tokens, temperature=0)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "stop", msg
    assert isinstance(msg.parsed, City)
    assert json.loads(msg.content) == msg.parsed.model_dump()
    assert msg.refusal is None


def test_response_format_json_schema_raw(srv):
    schema = {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]},
                                               "confidence": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["answer", "confidence"], "additionalProperties": False}
    r = srv.sync().chat.completions.create(
        model=srv.model, messages=[{"role": "user", "content": "Is Paris in France?"}], max_tokens=srv.json_tokens,
        temperature=0, response_format={"type": "json_schema",
                                        "json_schema": {"name": "verdict", "strict": True, "schema": schema}})
    assert r.choices[0].finish_reason == "stop"
    got = json.loads(r.choices[0].message.content)
    assert set(got) == {"answer", "confidence"}
    assert got["answer"] in ("yes", "no") and isinstance(got["confidence"], int) and 0 <= got["confidence"] <= 9


def test_response_format_json_object(srv):
    r = srv.sync().chat.completions.create(
        model=srv.model, messages=ASK_CITY, max_tokens=srv.json_tokens, temperature=0,
        response_format={"type": "json_object"})
    c = r.choices[0]
    if c.finish_reason == "stop":
        assert isinstance(json.loads(c.message.content), dict)
    else:  # cut by max_tokens: still the start of a JSON object
        assert c.finish_reason == "length" and c.message.content.lstrip().startswith("{")


def test_stream_helper_parses_response_format(srv):
    """``client.chat.completions.stream(response_format=Model)``: the SDK's accumulating stream."""
    with srv.sync().chat.completions.stream(model=srv.model, messages=ASK_CITY, response_format=City,
                                            max_tokens=srv.json_tokens, temperature=0) as stream:
        kinds = {event.type for event in stream}
        final = stream.get_final_completion()
    assert "content.delta" in kinds and "content.done" in kinds
    assert isinstance(final.choices[0].message.parsed, City)


def test_stream_tool_call_chunks(srv):
    chunks = list(srv.sync().chat.completions.create(
        model=srv.model, messages=ASK_WEATHER, tools=[WEATHER], max_tokens=srv.json_tokens, temperature=0, stream=True,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}))
    deltas = [tc for ch in chunks if ch.choices for tc in (ch.choices[0].delta.tool_calls or [])]
    # the call's first piece has its id and name, the others only pieces of its arguments
    assert deltas and all(d.index == 0 for d in deltas) and deltas[0].id.startswith("call_")
    assert deltas[0].function.name == "get_weather"
    assert all(d.id is None and d.function.name is None for d in deltas[1:])
    Weather.model_validate_json("".join(d.function.arguments or "" for d in deltas))
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_logprobs_greedy(srv):
    r = srv.sync().chat.completions.create(model=srv.model, messages=HI, max_tokens=8, temperature=0,
                                           logprobs=True, top_logprobs=3)
    c = r.choices[0]
    entries = c.logprobs.content
    assert len(entries) == r.usage.completion_tokens
    for e in entries:
        assert len(e.top_logprobs) == 3
        tops = [t.logprob for t in e.top_logprobs]
        assert tops == sorted(tops, reverse=True) and all(math.isfinite(t) and t <= 0 for t in tops)
        # greedy: the sampled token is the most likely one
        assert e.token == e.top_logprobs[0].token and e.logprob == pytest.approx(e.top_logprobs[0].logprob, abs=1e-5)
        assert e.bytes and all(0 <= b <= 255 for b in e.bytes)
        try:
            assert e.token == bytes(e.bytes).decode("utf-8")
        except UnicodeDecodeError:  # a token holding part of a character
            pass
    text = b"".join(bytes(e.bytes) for e in entries).decode("utf-8", errors="replace")
    if c.finish_reason == "length":
        assert text == c.message.content
    else:  # the end-of-generation token carries no text
        assert text.startswith(c.message.content)


def test_logprobs_stream_equals_whole(srv):
    kw = dict(model=srv.model, messages=HI, max_tokens=8, temperature=0, logprobs=True, top_logprobs=2)
    client = srv.sync()
    whole = client.chat.completions.create(**kw).choices[0].logprobs.content
    chunks = list(client.chat.completions.create(**kw, stream=True))
    streamed = [e for ch in chunks if ch.choices and ch.choices[0].logprobs
                for e in (ch.choices[0].logprobs.content or [])]
    assert [(e.token, e.bytes) for e in streamed] == [(e.token, e.bytes) for e in whole]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in whole], abs=1e-4)
    assert all(len(e.top_logprobs) == 2 for e in streamed)


def test_logprobs_off_by_default(srv):
    r = srv.sync().chat.completions.create(model=srv.model, messages=HI, max_tokens=2, temperature=0)
    assert r.choices[0].logprobs is None


def test_n2(srv):
    r = srv.sync().chat.completions.create(model=srv.model, messages=HI, max_tokens=4, temperature=1.0,
                                           seed=7, n=2, extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1]
    assert all(c.finish_reason == "length" and isinstance(c.message.content, str) for c in r.choices)
    one = srv.sync().chat.completions.create(model=srv.model, messages=HI, max_tokens=1, temperature=0)
    # the prompt counts once; completion tokens are summed over the choices
    assert usage3(r.usage) == (one.usage.prompt_tokens, 8, one.usage.prompt_tokens + 8)


def test_n2_stream(srv):
    chunks = list(srv.sync().chat.completions.create(
        model=srv.model, messages=HI, max_tokens=4, temperature=1.0, seed=7, n=2, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    finishes = {ch.choices[0].index: ch.choices[0].finish_reason
                for ch in chunks if ch.choices and ch.choices[0].finish_reason}
    assert finishes == {0: "length", 1: "length"}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8


def test_embeddings(srv):
    client = srv.sync()
    texts = ["The cat sat on the mat.", "Paris is the capital of France."]
    r = client.embeddings.create(model=srv.model, input=texts)  # the SDK asks for base64
    assert r.object == "list" and r.model == srv.model
    assert [d.index for d in r.data] == [0, 1] and all(d.object == "embedding" for d in r.data)
    assert all(len(d.embedding) == srv.n_embd for d in r.data)
    assert all(math.isfinite(x) for d in r.data for x in d.embedding)
    assert r.data[0].embedding != r.data[1].embedding
    assert r.usage.prompt_tokens > 0 and r.usage.total_tokens == r.usage.prompt_tokens
    floats = client.embeddings.create(model=srv.model, input=texts[0], encoding_format="float")
    assert len(floats.data) == 1
    assert floats.data[0].embedding == pytest.approx(r.data[0].embedding, rel=1e-5, abs=1e-6)


# ---- async ---------------------------------------------------------------------------------

def test_async_all_at_once(srv):
    """AsyncOpenAI: chat, a stream with usage, a named tool call, .parse() and embeddings, all in
    flight together."""
    async def main():
        client = srv.aio()
        tool = {"type": "function", "function": {"name": "get_weather"}}

        async def stream():
            s = await client.chat.completions.create(model=srv.model, messages=HI, max_tokens=16, temperature=0,
                                                     stream=True, stream_options={"include_usage": True})
            return [ch async for ch in s]

        try:
            return await asyncio.gather(
                client.chat.completions.create(model=srv.model, messages=HI, max_tokens=16, temperature=0),
                stream(),
                client.chat.completions.create(model=srv.model, messages=ASK_WEATHER, tools=[WEATHER],
                                               tool_choice=tool, max_tokens=srv.json_tokens, temperature=0),
                client.chat.completions.parse(model=srv.model, messages=ASK_CITY, response_format=City,
                                              max_tokens=srv.json_tokens, temperature=0),
                client.embeddings.create(model=srv.model, input="hello world"))
        finally:
            await client.close()

    whole, chunks, tooled, parsed, emb = asyncio.run(main())
    # batched together, the two greedy replies need not agree token for token (batch shapes change
    # the arithmetic); the stream's structure and usage must hold on their own
    u = chunks[-1].usage
    assert chunks[-1].choices == [] and u.prompt_tokens == whole.usage.prompt_tokens
    assert 0 < u.completion_tokens <= 16 and u.total_tokens == u.prompt_tokens + u.completion_tokens
    assert chunks[0].choices[0].delta.role == "assistant" and all(ch.usage is None for ch in chunks[:-1])
    assert isinstance(whole.choices[0].message.content, str)
    Weather.model_validate_json(check_weather_call(tooled.choices[0]).function.arguments)
    assert isinstance(parsed.choices[0].message.parsed, City)
    assert len(emb.data) == 1 and len(emb.data[0].embedding) == srv.n_embd


def test_async_stream_helper_tool(srv):
    async def main():
        client = srv.aio()
        try:
            async with client.chat.completions.stream(
                    model=srv.model, messages=ASK_CITY, tools=[openai.pydantic_function_tool(City)],
                    tool_choice={"type": "function", "function": {"name": "City"}},
                    max_tokens=srv.json_tokens, temperature=0) as stream:
                kinds = [event.type async for event in stream]
                return kinds, await stream.get_final_completion()
        finally:
            await client.close()

    kinds, final = asyncio.run(main())
    assert "tool_calls.function.arguments.done" in kinds
    call = check_weather_call(final.choices[0], name="City")
    assert isinstance(call.function.parsed_arguments, City)
