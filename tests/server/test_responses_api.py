"""OpenAI's Responses API (/v1/responses) against the real server and model, through the
``openai`` SDK: create (a string, items with instructions), stream (events in order, numbered,
the SDK's own accumulator), parse (a pydantic text_format held by the json_schema constraint),
function tools (a forced call, its output sent back), previous_response_id across three turns
prefilling only the new items, GET / DELETE / cancel, another key's 404, the tool types Codex
sends that are left out, a bad body's 400, and input_tokens against usage.

One server for the module (a key policy with two keys, /metrics open), short replies."""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from typing import Literal

import pytest
from pydantic import BaseModel

from superfluid.plugins.http.keys.policy import hash_secret

openai = pytest.importorskip("openai")

KEYS = {"alice": "sk-alice-responses", "bob": "sk-bob-responses"}
POLICY = "".join(f'[keys.{name}]\nsha256 = "{hash_secret(secret)}"\n\n' for name, secret in KEYS.items())
# long enough that the history dominates a later turn's prompt
INSTRUCTIONS = ("You are a careful assistant for a small public library. Answer briefly and politely. " * 5).strip()
WEATHER = {"type": "function", "name": "get_weather", "description": "Get the weather for a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24}},
                          "required": ["city"], "additionalProperties": False}}


@pytest.fixture(scope="module")
def srv(start_server, tmp_path_factory):
    policy = tmp_path_factory.mktemp("responses-keys") / "keys.toml"
    policy.write_text(POLICY)
    return start_server("--key-policy", str(policy), "--http-open-probes", "--max-batch", "4")


def client_for(srv, who: str = "alice"):
    return openai.OpenAI(base_url=srv.base + "/v1", api_key=KEYS[who], timeout=120, max_retries=0)


@pytest.fixture(scope="module")
def client(srv):
    return client_for(srv)


def post_raw(srv, path: str, body: dict, who: str = "alice") -> tuple[int, bytes]:
    req = urllib.request.Request(srv.base + path, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json",
                                          "Authorization": f"Bearer {KEYS[who]}"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def sse_events(raw: bytes) -> list[dict]:
    out = []
    for block in raw.decode().split("\n\n"):
        lines = [line for line in block.split("\n") if line and not line.startswith(":")]
        if not lines:
            continue
        kind = next(line[7:] for line in lines if line.startswith("event: "))
        data = json.loads(next(line[6:] for line in lines if line.startswith("data: ")))
        assert data["type"] == kind
        out.append(data)
    return out


def prefill_total(srv) -> float:
    return srv.settled_metric("superfluid_prefill_tokens_total")


# ---- create, stream, parse ---------------------------------------------------------------------

def test_create_with_a_string_and_with_items_and_instructions(client):
    first = client.responses.create(model="smollm2", input="Say hello.", max_output_tokens=8, temperature=0)
    assert first.id.startswith("resp_") and first.object == "response" and first.model == "smollm2"
    assert first.status in ("completed", "incomplete") and first.output_text
    assert first.output[0].type == "message" and first.output[0].role == "assistant"
    assert first.usage.input_tokens > 5 and 0 < first.usage.output_tokens <= 8
    assert first.usage.total_tokens == first.usage.input_tokens + first.usage.output_tokens
    items = client.responses.create(
        model="smollm2", instructions="Answer in French.", max_output_tokens=8, temperature=0, store=False,
        input=[{"role": "user", "content": "Hi!"}, {"type": "message", "role": "assistant",
                                                   "content": [{"type": "output_text", "text": "Bonjour !"}]},
               {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "And goodbye?"}]}])
    assert items.output_text and items.store is False and items.instructions == "Answer in French."
    # all three messages are in the prompt, after the instructions
    alone = client.responses.input_tokens.count(model="smollm2", instructions="Answer in French.",
                                                input="And goodbye?")
    assert items.usage.input_tokens > alone.input_tokens + 8


def test_stream_events_arrive_in_order_and_the_final_response_is_the_text(client):
    seen = []
    with client.responses.stream(model="smollm2", input="Answer with one word: what color is the sky?",
                                 max_output_tokens=48, temperature=0) as stream:
        for event in stream:
            seen.append(event)
        final = stream.get_final_response()
    kinds = [e.type for e in seen]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in seen] == list(range(len(seen)))
    text = "".join(e.delta for e in seen if e.type == "response.output_text.delta")
    assert text and final.output_text == text and final.status == "completed"
    assert final.id == seen[0].response.id and final.usage.output_tokens > 0


class Verdict(BaseModel):
    answer: Literal["yes", "no"]
    sure: bool


def test_parse_with_a_pydantic_text_format(client):
    parsed = client.responses.parse(model="smollm2", input="Is water wet? Reply in JSON.", text_format=Verdict,
                                    max_output_tokens=40, temperature=0)
    assert parsed.status == "completed"
    assert isinstance(parsed.output_parsed, Verdict)
    assert parsed.output_parsed == Verdict.model_validate_json(parsed.output_text)


# ---- tools -------------------------------------------------------------------------------------

def test_a_forced_function_call_and_its_output_sent_back(client):
    ask = {"role": "user", "content": "What is the weather in Paris?"}
    called = client.responses.create(model="smollm2", input=[ask], tools=[WEATHER], max_output_tokens=48,
                                     tool_choice={"type": "function", "name": "get_weather"}, temperature=0)
    call = called.output[-1]
    assert call.type == "function_call" and call.name == "get_weather" and call.status == "completed"
    assert call.id.startswith("fc_") and call.call_id.startswith("call_")
    assert set(json.loads(call.arguments)) == {"city"}
    result = {"type": "function_call_output", "call_id": call.call_id, "output": '{"sky": "sunny", "celsius": 21}'}
    # the whole history sent back (store false, as Codex does)...
    again = client.responses.create(model="smollm2", input=[ask, *[o.model_dump() for o in called.output], result],
                                    tools=[WEATHER], max_output_tokens=16, temperature=0, store=False)
    assert again.output_text
    # ...or only the output, continuing the stored response: the call's prompt comes from the cache
    chained = client.responses.create(model="smollm2", previous_response_id=called.id, input=[result],
                                      tools=[WEATHER], max_output_tokens=16, temperature=0)
    assert chained.output_text and chained.previous_response_id == called.id
    assert chained.usage.input_tokens == again.usage.input_tokens  # the same conversation, rendered the same
    assert chained.usage.input_tokens_details.cached_tokens >= called.usage.input_tokens


def test_codex_tool_types_are_left_out_not_refused(srv):
    body = {"model": "smollm2", "stream": True, "store": False, "tool_choice": "auto", "parallel_tool_calls": False,
            "reasoning": {"effort": "medium", "summary": "auto"}, "include": ["reasoning.encrypted_content"],
            "prompt_cache_key": "codex-session", "client_metadata": {"x-codex": "1"}, "max_output_tokens": 8,
            "input": [{"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Be brief."}]},
                      {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi."}]}],
            "tools": [{**WEATHER, "strict": False},
                      {"type": "namespace", "name": "mcp__docs", "description": "docs",
                       "tools": [{"type": "function", "name": "search", "parameters": {"type": "object"}}]},
                      {"type": "web_search", "external_web_access": False}]}
    status, raw = post_raw(srv, "/v1/responses", body)
    assert status == 200, raw
    events = sse_events(raw)
    assert events[0]["type"] == "response.created" and events[-1]["type"] in ("response.completed",
                                                                               "response.incomplete")
    final = events[-1]["response"]
    assert [t["type"] for t in final["tools"]] == ["function", "namespace", "web_search"]  # echoed as sent
    # the left-out tools are not in the prompt: it is as long as with the function tool alone
    count = {k: body[k] for k in ("model", "input", "tool_choice", "parallel_tool_calls")}
    status, alone = post_raw(srv, "/v1/responses/input_tokens", {**count, "tools": [WEATHER]})
    assert status == 200 and json.loads(alone)["input_tokens"] == final["usage"]["input_tokens"]


def test_a_bad_body_is_a_400_naming_the_field(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model="smollm2", input=[{"role": "user", "content": [
            {"type": "input_text", "text": "What is this?"},
            {"type": "input_image", "image_url": "data:image/png;base64,AAAA"}]}])
    # the default model is text-only: an image is a 400 that says so
    assert info.value.body["code"] == "model_not_multimodal" and "text-only" in info.value.body["message"]
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model="smollm2", input="hi", tools=[WEATHER],
                                tool_choice={"type": "function", "name": "get_time"})
    assert info.value.body["param"] == "tool_choice"


def test_input_tokens_equals_usage_input_tokens(client):
    ask = dict(model="smollm2", instructions="Be terse.", tools=[WEATHER],
               input=[{"role": "user", "content": "Weather in Oslo?"}])
    counted = client.responses.input_tokens.count(**ask)
    made = client.responses.create(**ask, max_output_tokens=4, store=False)
    assert counted.object == "response.input_tokens" and counted.input_tokens == made.usage.input_tokens


# ---- store and previous_response_id ------------------------------------------------------------

def test_previous_response_id_sends_and_prefills_only_the_new_items(srv, client):
    turns, prefilled = [], []
    previous = None
    for text, truncation in (("What are the opening hours?", "disabled"), ("And on Sundays?", "disabled"),
                             ("Thank you, goodbye.", "auto")):  # auto: measured against the context, not cut
        before = prefill_total(srv)
        reply = client.responses.create(model="smollm2", instructions=INSTRUCTIONS, input=text, truncation=truncation,
                                        previous_response_id=previous, max_output_tokens=10, temperature=0)
        prefilled.append(prefill_total(srv) - before)
        turns.append(reply)
        previous = reply.id
    prompts = [t.usage.input_tokens for t in turns]
    assert prompts[0] < prompts[1] < prompts[2]  # each turn's prompt holds the conversation so far
    for turn, prompt, fresh in zip(turns[1:], prompts[1:], prefilled[1:]):
        assert fresh < prompt / 2, (prompts, prefilled)
        assert turn.usage.input_tokens_details.cached_tokens >= prompt / 2
    assert prefilled[2] < prompts[2] - prompts[1] + 24, (prompts, prefilled)  # about its new items only
    # only the latest response continues its conversation
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model="smollm2", input="again", previous_response_id=turns[0].id)
    assert info.value.body["param"] == "previous_response_id" and turns[2].id in info.value.body["message"]


def test_get_delete_and_another_keys_404(srv, client):
    made = client.responses.create(model="smollm2", input="Name a fruit.", max_output_tokens=6, temperature=0,
                                   metadata={"case": "get"})
    got = client.responses.retrieve(made.id)
    assert got.id == made.id and got.output_text == made.output_text and got.metadata == {"case": "get"}
    assert client.responses.cancel(made.id).id == made.id  # a finished response: unchanged
    bob = client_for(srv, "bob")
    for act in (lambda: bob.responses.retrieve(made.id), lambda: bob.responses.delete(made.id),
                lambda: bob.responses.create(model="smollm2", input="hi", previous_response_id=made.id)):
        with pytest.raises(openai.NotFoundError):
            act()
    client.responses.delete(made.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(made.id)
    with pytest.raises(openai.NotFoundError):  # nothing left to continue
        client.responses.create(model="smollm2", input="hi", previous_response_id=made.id)
    unstored = client.responses.create(model="smollm2", input="Hi.", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_cancel_ends_a_streaming_response_as_cancelled(client):
    cancelled = {}
    with client.responses.stream(model="smollm2", input="Count from 1 to 300, separated by commas.",
                                 max_output_tokens=400, temperature=0) as stream:
        events = []
        for event in stream:
            events.append(event)
            if event.type == "response.output_text.delta" and not cancelled:
                rid = events[0].response.id  # cancelled from another connection, as another process would
                worker = threading.Thread(target=lambda: cancelled.update(r=client.responses.cancel(rid)))
                worker.start()
        worker.join(60)
    assert cancelled["r"].status == "cancelled"
    last = events[-1]
    assert last.type == "response.incomplete" and last.response.status == "cancelled"
    assert 0 < last.response.usage.output_tokens < 400
    assert client.responses.retrieve(rid).status == "cancelled"  # stored as it ended
