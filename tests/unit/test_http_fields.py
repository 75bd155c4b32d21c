"""The OpenAI request fields beyond plain sampling, parsed and shaped without a server:
``response_format``, ``logprobs``/``top_logprobs``, ``n``/``best_of``, ``logit_bias``, and the
logprobs objects of both APIs (parsed by plugins/http/openai/protocol.py and chat_protocol.py; then
plugins/http/prepare/: params.py, response_format.py, logprob_format.py)."""

from __future__ import annotations

import pytest

from superfluid.core.constrain import check
from superfluid.core.errors import InvalidRequest
from superfluid.core.request import JsonChoice, JsonConstraint, SamplingParams
from superfluid.core.tick import TokenLogprob
from superfluid.plugins.http.openai.chat_protocol import ChatCompletionRequest
from superfluid.plugins.http.openai.protocol import CompletionRequest
from superfluid.plugins.http.prepare import logprob_format, params, response_format
from superfluid.plugins.http.typed import parse
from superfluid.plugins.http.prepare.logprob_format import CompletionLogprobs, TokenText, chat_entries


def refused(fn, *args):
    with pytest.raises(InvalidRequest) as info:
        fn(*args)
    return info.value.param, info.value.code


def chat(body: dict) -> ChatCompletionRequest:
    """A chat request holding ``body``'s fields (and one message)."""
    return parse(ChatCompletionRequest, {"messages": [{"role": "user", "content": "hi"}], **body})


def completion(body: dict) -> CompletionRequest:
    return parse(CompletionRequest, {"prompt": "hi", **body})


def constraint(body: dict):
    return response_format.constraint(chat(body).response_format)


def chat_logprobs(body: dict):
    return logprob_format.chat_request(chat(body))


def completion_logprobs(body: dict):
    return logprob_format.completion_request(completion(body))


def logit_bias(body: dict, n_vocab: int):
    return params.logit_bias(chat(body), n_vocab)


# ---- response_format ------------------------------------------------------------------------

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
          "additionalProperties": False}


def test_response_formats_become_constraints():
    assert constraint({}) is None
    assert constraint({"response_format": {"type": "text"}}) is None
    assert constraint({"response_format": {"type": "json_object"}}) == JsonConstraint(
        choices=(JsonChoice("", {"type": "object"}),))
    fmt = {"type": "json_schema", "json_schema": {"name": "A-b_1", "schema": SCHEMA, "strict": True,
                                                  "description": "d"}}
    assert constraint({"response_format": fmt}) == JsonConstraint(choices=(JsonChoice("", SCHEMA),))


@pytest.mark.parametrize("fmt, param, code", [
    ("json", "response_format", "invalid_type"),
    ({"type": "xml"}, "response_format.type", "invalid_value"),
    ({}, "response_format.type", "missing_required_parameter"),
    ({"type": "json_object", "schema": {}}, "response_format.schema", "unknown_parameter"),
    ({"type": "json_schema"}, "response_format.json_schema", "missing_required_parameter"),
    ({"type": "json_schema", "json_schema": []}, "response_format.json_schema", "invalid_type"),
    ({"type": "json_schema", "json_schema": {"schema": SCHEMA}}, "response_format.json_schema.name",
     "missing_required_parameter"),
    ({"type": "json_schema", "json_schema": {"name": "has space"}}, "response_format.json_schema.name", "invalid_value"),
    ({"type": "json_schema", "json_schema": {"name": "x" * 65}}, "response_format.json_schema.name", "invalid_value"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": "{}"}}, "response_format.json_schema.schema",
     "invalid_type"),
    ({"type": "json_schema", "json_schema": {"name": "x", "strict": "yes"}}, "response_format.json_schema.strict",
     "invalid_type"),
    ({"type": "json_schema", "json_schema": {"name": "x", "format": {}}}, "response_format.json_schema.format",
     "unknown_parameter"),
])
def test_malformed_response_formats_name_the_part(fmt, param, code):
    assert refused(constraint, {"response_format": fmt}) == (param, code)


def test_what_pydantic_and_the_openai_sdk_send_is_enforceable():
    pydantic = pytest.importorskip("pydantic")
    to_strict = pytest.importorskip("openai.lib._pydantic").to_strict_json_schema

    class Step(pydantic.BaseModel):
        explanation: str
        output: str

    class Answer(pydantic.BaseModel):
        steps: list[Step]
        final: str
        score: int | None = None

    schema = to_strict(Answer)
    assert "$defs" in schema and schema["additionalProperties"] is False
    body = {"response_format": {"type": "json_schema", "json_schema": {"name": "Answer", "schema": schema,
                                                                       "strict": True}}}
    check(SamplingParams(json_schema=constraint(body)))  # what ModelLoop.submit asks


# ---- logprobs -------------------------------------------------------------------------------

def test_chat_logprobs_fields():
    assert chat_logprobs({}) is None
    assert chat_logprobs({"logprobs": False}) is None
    assert chat_logprobs({"logprobs": True}) == 0
    assert chat_logprobs({"logprobs": True, "top_logprobs": 20}) == 20
    assert refused(chat_logprobs, {"logprobs": True, "top_logprobs": 21}) == ("top_logprobs",
                                                                                           "invalid_value")
    assert refused(chat_logprobs, {"top_logprobs": 2}) == ("top_logprobs", "invalid_value")
    assert refused(chat_logprobs, {"logprobs": 1}) == ("logprobs", "invalid_type")


def test_completion_logprobs_field():
    assert completion_logprobs({}) is None
    assert completion_logprobs({"logprobs": False}) is None
    assert completion_logprobs({"logprobs": 0}) == 0
    assert completion_logprobs({"logprobs": 5}) == 5
    assert refused(completion_logprobs, {"logprobs": 6}) == ("logprobs", "invalid_value")
    assert refused(completion_logprobs, {"logprobs": True}) == ("logprobs", "invalid_type")


# Token 1 is "é" split over two tokens (2, 3); 4 is " a"; 5 is special (no bytes).
PIECES = {1: b"x", 2: b"\xc3", 3: b"\xa9", 4: b" a", 5: b""}
TEXT = TokenText(lambda t: PIECES[t])


def test_chat_entries_keep_the_exact_bytes_and_never_write_a_replacement_character():
    lps = [TokenLogprob(2, -0.5, ((2, -0.5), (4, -1.5))), TokenLogprob(3, float("-inf"), ((3, -0.1),))]
    assert chat_entries(lps, TEXT, 1) == [
        {"token": "", "logprob": -0.5, "bytes": [0xc3], "top_logprobs": [{"token": "", "logprob": -0.5,
                                                                        "bytes": [0xc3]}]},
        {"token": "", "logprob": -9999.0, "bytes": [0xa9], "top_logprobs": [{"token": "", "logprob": -0.1,
                                                                           "bytes": [0xa9]}]}]
    assert chat_entries([TokenLogprob(4, -1.0, ((4, -1.0), (1, -2.0)))], TEXT, 0)[0]["top_logprobs"] == []


def test_completion_logprobs_with_an_echoed_prompt_count_offsets_over_the_text():
    built = CompletionLogprobs(TEXT, 2)
    prompt = built.prompt([5, 1, 4], (TokenLogprob(1, -3.0, ((4, -0.2), (1, -3.0))), TokenLogprob(4, -0.7)))
    assert prompt == {"tokens": ["", "x", " a"], "token_logprobs": [None, -3.0, -0.7],
                      "top_logprobs": [None, {" a": -0.2, "x": -3.0}, {}], "text_offset": [0, 0, 1]}
    part = built.add([TokenLogprob(2, -0.1, ((2, -0.1),)), TokenLogprob(3, -0.2, ((3, -0.2),)),
                      TokenLogprob(4, -0.3, ((4, -0.3),))])
    assert part["text_offset"] == [3, 3, 4] and part["tokens"] == ["", "", " a"]  # "é" is one character
    assert built.whole["tokens"] == ["", "x", " a", "", "", " a"]
    assert built.whole["text_offset"] == [0, 0, 1, 3, 3, 4]


def test_a_prompt_scored_short_leaves_nulls_not_a_crash():
    built = CompletionLogprobs(TEXT, 0)
    assert built.prompt([1, 4, 1], ())["token_logprobs"] == [None, None, None]


# ---- n, best_of, logit_bias -------------------------------------------------------------------

def test_n_and_best_of():
    assert completion({}).n == 1 and completion({"n": 16}).n == 16
    assert completion({"n": 3, "best_of": 3}).n == 3
    assert refused(completion, {"n": 0}) == ("n", "invalid_value")
    assert refused(completion, {"n": 17}) == ("n", "invalid_value")
    assert refused(completion, {"n": 2, "best_of": 3}) == ("best_of", "unsupported_value")
    assert refused(completion, {"best_of": 2}) == ("best_of", "unsupported_value")


def test_logit_bias():
    assert logit_bias({}, 100) == () and logit_bias({"logit_bias": {}}, 100) == ()
    assert logit_bias({"logit_bias": {"7": -100, "3": 2.5}}, 100) == ((3, 2.5), (7, -100.0))
    for bad, code in (([1], "invalid_type"), ({"a": 1}, "invalid_value"), ({"-1": 1}, "invalid_value"),
                      ({"100": 1}, "invalid_value"), ({"1" * 5000: 1}, "invalid_value"),
                      ({"5": 100.5}, "invalid_value"), ({"5": "1"}, "invalid_type"), ({"5": True}, "invalid_type"),
                      ({str(i): 1 for i in range(301)}, "invalid_value")):
        param, got = refused(logit_bias, {"logit_bias": bad}, 1000 if len(bad) > 300 else 100)
        assert param.split(".")[0] == "logit_bias" and got == code, (bad, param, got)


# ---- fields accepted and ignored ----------------------------------------------------------------

@pytest.mark.parametrize("field, value", [("metadata", True), ("metadata", "x"), ("store", "yes"),
                                          ("service_tier", 1), ("reasoning_effort", {}),
                                          ("safety_identifier", 3), ("prompt_cache_key", [])])
def test_ignored_fields_still_have_their_type(field, value):
    assert refused(chat, {field: value}) == (field, "invalid_type")


def test_ignored_fields_of_their_type_pass():
    chat({"metadata": {"a": "b"}, "store": False, "service_tier": "auto", "reasoning_effort": "low",
                        "safety_identifier": "u1", "prompt_cache_key": "k", "stream_options": None})
