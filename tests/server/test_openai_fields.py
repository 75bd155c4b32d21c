"""The OpenAI request fields beyond plain sampling, against the real server and SmolLM2:
``response_format`` (and the openai SDK's ``.parse()``), ``logprobs``, completions ``echo`` with
prompt scoring, ``n`` (one prefill for all choices), ``logit_bias``, and their 400s."""

from __future__ import annotations

import json
import random
import typing
import urllib.request

import pytest

from .test_bad_input import body, post

ASK = [{"role": "user", "content": "Give me a JSON object describing a cat named Tom, aged 3."}]
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "age"], "additionalProperties": False}


def chat(server, **fields):
    return post(server, "/v1/chat/completions", body({"model": "smollm2", "messages": ASK, "max_tokens": 16,
                                                      "temperature": 0, **fields}))


def sse(server, path: str, obj: dict) -> list:
    """A stream's events: each chunk's JSON, and the string "[DONE]"."""
    req = urllib.request.Request(server.base + path, data=body(obj), method="POST",
                                 headers={"Content-Type": "application/json"})
    out = []
    with urllib.request.urlopen(req, timeout=120) as r:
        for line in r:
            line = line.decode().strip()
            if line.startswith("data: "):
                data = line[len("data: "):]
                out.append(data if data == "[DONE]" else json.loads(data))
    return out


# ---- response_format ------------------------------------------------------------------------

def test_json_formats_hold_the_reply_to_the_schema(server):
    status, got = chat(server, max_tokens=24, response_format={"type": "json_schema", "json_schema": {
        "name": "person", "schema": PERSON, "strict": True}})
    assert status == 200, got
    value = json.loads(got["choices"][0]["message"]["content"])
    assert set(value) == {"name", "age"} and isinstance(value["name"], str) and len(value["name"]) <= 8
    assert isinstance(value["age"], int) and 0 <= value["age"] <= 99
    status, got = chat(server, response_format={"type": "json_object"}, max_tokens=16,
                       messages=[{"role": "user", "content": 'Reply {"a": 1}'}])
    assert status == 200, got
    text = got["choices"][0]["message"]["content"]
    assert text.startswith("{")
    if got["choices"][0]["finish_reason"] == "stop":
        assert isinstance(json.loads(text), dict)


def test_the_openai_sdk_parse_with_a_pydantic_model(client):
    pydantic = pytest.importorskip("pydantic")

    class Pet(pydantic.BaseModel):  # nested: the SDK's strict schema has $defs and a $ref
        kind: typing.Literal["dog", "cat"]
        legs: int = pydantic.Field(ge=0, le=8)

    class Owner(pydantic.BaseModel):
        pet: Pet

    parse = getattr(client.chat.completions, "parse", None) or client.beta.chat.completions.parse
    got = parse(model="smollm2", messages=[{"role": "user", "content": "Describe a happy dog owner."}],
                response_format=Owner, temperature=0, max_tokens=20)
    owner = got.choices[0].message.parsed
    assert isinstance(owner, Owner) and owner.pet.kind in ("dog", "cat") and 0 <= owner.pet.legs <= 8


def test_a_schema_that_cannot_be_enforced_is_a_400_not_free_text(server):
    status, got = chat(server, response_format={"type": "json_schema", "json_schema": {
        "name": "s", "schema": {"type": "string", "format": "made-up"}}})
    assert status == 400 and got["error"]["code"] == "unsupported_schema"
    assert got["error"]["param"] == "response_format" and "made-up" in got["error"]["message"]


# ---- logprobs -------------------------------------------------------------------------------

def test_chat_logprobs_greedy_picks_its_top_candidate_streamed_or_not(server):
    fields = {"logprobs": True, "top_logprobs": 3, "max_tokens": 8,
              "messages": [{"role": "user", "content": "Name three colours."}]}
    status, got = chat(server, **fields)
    assert status == 200, got
    content = got["choices"][0]["logprobs"]["content"]
    assert len(content) == got["usage"]["completion_tokens"]
    for entry in content:
        assert len(entry["top_logprobs"]) == 3 and entry["logprob"] <= 0
        assert entry["top_logprobs"][0]["bytes"] == entry["bytes"]  # greedy: the chosen token is the best
        assert abs(entry["top_logprobs"][0]["logprob"] - entry["logprob"]) < 1e-4
        assert "\ufffd" not in entry["token"]
    assert b"".join(bytes(e["bytes"]) for e in content).decode("utf-8", "replace") \
        == got["choices"][0]["message"]["content"]
    events = sse(server, "/v1/chat/completions", {"model": "smollm2", "messages": fields["messages"],
                                                  "max_tokens": 8, "temperature": 0, "logprobs": True,
                                                  "top_logprobs": 3, "stream": True})
    streamed = [e for ev in events if ev != "[DONE]" for c in ev["choices"] if c.get("logprobs")
                for e in c["logprobs"]["content"]]
    assert [e["bytes"] for e in streamed] == [e["bytes"] for e in content]
    assert all(abs(a["logprob"] - b["logprob"]) < 1e-3 for a, b in zip(streamed, content))


def test_completions_echo_scores_the_prompt_with_max_tokens_0(server):
    prompt = "The capital of France is Paris."
    status, got = post(server, "/v1/completions", body({"model": "smollm2", "prompt": prompt, "echo": True,
                                                        "logprobs": 2, "max_tokens": 0}))
    assert status == 200, got
    choice, usage = got["choices"][0], got["usage"]
    assert choice["text"] == prompt and choice["finish_reason"] == "length" and usage["completion_tokens"] == 0
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == usage["prompt_tokens"] == len(lp["text_offset"])
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(v <= 0 for v in lp["token_logprobs"][1:]) and all(len(t) <= 2 for t in lp["top_logprobs"][1:])
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
    assert "".join(lp["tokens"]) == prompt
    # generating after the echo: the text goes on, the logprobs too
    status, got = post(server, "/v1/completions", body({"model": "smollm2", "prompt": prompt, "echo": True,
                                                        "logprobs": 0, "max_tokens": 3, "temperature": 0}))
    lp = got["choices"][0]["logprobs"]
    assert got["choices"][0]["text"].startswith(prompt)
    assert len(lp["tokens"]) == got["usage"]["prompt_tokens"] + got["usage"]["completion_tokens"]


def test_a_streamed_echo_with_logprobs_opens_with_the_scored_prompt(server):
    prompt = "The capital of France is Paris."
    fields = {"model": "smollm2", "prompt": prompt, "echo": True, "logprobs": 1, "max_tokens": 4,
              "temperature": 0, "ignore_eos": True}
    status, whole = post(server, "/v1/completions", body(fields))
    assert status == 200, whole
    events = [e for e in sse(server, "/v1/completions", {**fields, "stream": True}) if e != "[DONE]"]
    chunks = [c for e in events for c in e["choices"]]
    assert chunks[0]["text"] == prompt  # the echoed prompt comes first, with its scores
    first = chunks[0]["logprobs"]
    n_prompt = whole["usage"]["prompt_tokens"]
    assert len(first["tokens"]) == n_prompt and first["token_logprobs"][0] is None
    merged = {k: [v for c in chunks if c.get("logprobs") for v in c["logprobs"][k]]
              for k in ("tokens", "text_offset")}
    lp = whole["choices"][0]["logprobs"]
    assert merged["tokens"] == lp["tokens"] and merged["text_offset"] == lp["text_offset"]
    streamed = [v for c in chunks if c.get("logprobs") for v in c["logprobs"]["token_logprobs"]]
    assert all((a is None and b is None) or abs(a - b) < 1e-3 for a, b in zip(streamed, lp["token_logprobs"]))
    assert "".join(c["text"] for c in chunks) == whole["choices"][0]["text"]


# ---- n ----------------------------------------------------------------------------------------

def _prefilled(server) -> float:
    return server.metrics().get('superfluid_prefill_tokens_total{model="smollm2"}', 0.0)


def test_n_choices_share_one_prefill_and_sum_their_usage(server):
    rng = random.Random()
    words = " ".join(rng.choice(["alpha", "river", "stone", "cloud", "ember", "maple", "quartz", "delta"])
                     for _ in range(40))
    before = _prefilled(server)
    status, got = post(server, "/v1/completions", body({"model": "smollm2", "prompt": words, "n": 4,
                                                        "max_tokens": 6, "temperature": 1.0, "seed": 3}))
    assert status == 200, got
    assert [c["index"] for c in got["choices"]] == [0, 1, 2, 3]
    usage = got["usage"]
    assert 4 <= usage["completion_tokens"] <= 24 and usage["total_tokens"] == usage["prompt_tokens"] + usage[
        "completion_tokens"]
    prefilled = _prefilled(server) - before
    assert prefilled < 1.5 * usage["prompt_tokens"], (prefilled, usage)  # once, not 4 times

    events = sse(server, "/v1/chat/completions", {"model": "smollm2", "messages": ASK, "n": 2, "max_tokens": 4,
                                                  "stream": True, "stream_options": {"include_usage": True}})
    assert events.count("[DONE]") == 1 and events[-1] == "[DONE]"
    chunks = events[:-1]
    assert {c["choices"][0]["index"] for c in chunks if c["choices"]} == {0, 1}
    finishes = [c["choices"][0]["index"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert sorted(finishes) == [0, 1]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] <= 8


# ---- logit_bias -------------------------------------------------------------------------------

def test_logit_bias_can_forbid_the_greedy_first_token(server):
    ask = {"model": "smollm2", "prompt": "The capital of France is", "max_tokens": 1, "temperature": 0,
           "logprobs": 0}
    status, got = post(server, "/v1/completions", body(ask))
    first = got["choices"][0]["logprobs"]["tokens"][0]
    status, ids = post(server, "/tokenize", body({"content": first, "add_special": False}))
    assert status == 200 and len(ids["tokens"]) == 1, ids
    token = ids["tokens"][0]
    token = token["id"] if isinstance(token, dict) else token
    status, biased = post(server, "/v1/completions", body({**ask, "logit_bias": {str(token): -100}}))
    assert status == 200, biased
    assert biased["choices"][0]["logprobs"]["tokens"][0] != first


# ---- bad input --------------------------------------------------------------------------------

@pytest.mark.parametrize("fields, param", [
    ({"n": 0}, "n"), ({"n": 17}, "n"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"), ({"top_logprobs": 2}, "top_logprobs"),
    ({"logit_bias": {"hello": 1}}, "logit_bias"), ({"logit_bias": {"5": 150}}, "logit_bias"),
    ({"logit_bias": {"99999999": 1}}, "logit_bias"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}}, "response_format.json_schema.name"),
])
def test_bad_fields_are_400s_naming_them(server, fields, param):
    status, got = chat(server, **fields)
    assert status == 400 and got["error"]["param"] == param, got


def test_a_forced_call_whose_schema_cannot_be_enforced_is_refused(server):
    tool = {"type": "function", "function": {"name": "pay", "parameters": {
        "type": "object", "properties": {"card": {"type": "string", "format": "credit-card"}}}}}
    status, got = post(server, "/v1/chat/completions", body({
        "model": "smollm2", "messages": [{"role": "user", "content": "pay"}], "tools": [tool],
        "tool_choice": "required", "max_tokens": 16}))
    assert status == 400, got
    err = got["error"]
    assert (err["code"], err["param"]) == ("unsupported_schema", "tools") and "credit-card" in err["message"]


def test_fields_openai_sends_for_caching_and_safety_are_accepted(server):
    status, got = post(server, "/v1/chat/completions", body({
        "model": "smollm2", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
        "prompt_cache_key": "team-a", "safety_identifier": "user-1"}))
    assert status == 200, got
