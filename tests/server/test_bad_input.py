"""Bad input against the real server: a 4xx OpenAI-style error body, and nothing else disturbed."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest


def post(server, path, data: bytes, headers=None):
    req = urllib.request.Request(server.base + path, data=data, method="POST",
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def body(obj) -> bytes:
    return json.dumps(obj).encode()


CHAT = {"model": "smollm2", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
COMP = {"model": "smollm2", "prompt": "hi", "max_tokens": 4}

CASES = [
    ("malformed json", "/v1/chat/completions", b'{"model": "smollm2", "messages": [', 400, "invalid_json"),
    ("not an object", "/v1/completions", b'[1, 2, 3]', 400, "invalid_body"),
    ("empty body", "/v1/completions", b'', 400, "invalid_body"),
    ("non-utf8 body", "/v1/completions", b'{"prompt": "\xff\xfe"}', 400, "invalid_encoding"),
    ("missing messages", "/v1/chat/completions", body({"model": "smollm2"}), 400, "missing_required_parameter"),
    ("missing prompt", "/v1/completions", body({"model": "smollm2"}), 400, "missing_required_parameter"),
    ("messages wrong type", "/v1/chat/completions", body({**CHAT, "messages": "hi"}), 400, "invalid_type"),
    ("bad role", "/v1/chat/completions", body({**CHAT, "messages": [{"role": "robot", "content": "x"}]}), 400, "invalid_value"),
    ("prompt wrong type", "/v1/completions", body({**COMP, "prompt": 42}), 400, "invalid_type"),
    ("empty prompt", "/v1/completions", body({**COMP, "prompt": ""}), 400, "invalid_value"),
    ("negative max_tokens", "/v1/completions", body({**COMP, "max_tokens": -5}), 400, "invalid_value"),
    ("message name not a string", "/v1/chat/completions",
     body({**CHAT, "messages": [{"role": "user", "content": "x", "name": [1]}]}), 400, "invalid_type"),
    ("infill n_predict wrong type", "/infill", body({"input_prefix": "a", "input_suffix": "b", "n_predict": "x"}),
     400, "invalid_type"),
    ("max_tokens wrong type", "/v1/completions", body({**COMP, "max_tokens": "ten"}), 400, "invalid_type"),
    ("huge max_tokens", "/v1/completions", body({**COMP, "max_tokens": 10**9}), 400, "context_length_exceeded"),
    ("temperature out of range", "/v1/completions", body({**COMP, "temperature": 7}), 400, "invalid_value"),
    ("temperature wrong type", "/v1/chat/completions", body({**CHAT, "temperature": "hot"}), 400, "invalid_type"),
    ("stop wrong type", "/v1/completions", body({**COMP, "stop": 5}), 400, "invalid_type"),
    ("unknown field", "/v1/chat/completions", body({**CHAT, "frobnicate": True}), 400, "unknown_parameter"),
    ("n above 16", "/v1/completions", body({**COMP, "n": 17}), 400, "invalid_value"),
    ("logprobs above 5", "/v1/completions", body({**COMP, "logprobs": 6}), 400, "invalid_value"),
    ("logit_bias key not a token", "/v1/completions", body({**COMP, "logit_bias": {"x": 1}}), 400, "invalid_value"),
    ("logit_bias out of range", "/v1/completions", body({**COMP, "logit_bias": {"5": 101}}), 400, "invalid_value"),
    ("unknown response_format", "/v1/chat/completions", body({**CHAT, "response_format": {"type": "yaml"}}),
     400, "invalid_value"),
    ("schema llguidance cannot enforce", "/v1/chat/completions",
     body({**CHAT, "response_format": {"type": "json_schema", "json_schema": {
         "name": "x", "schema": {"type": "string", "format": "made-up"}}}}), 400, "unsupported_schema"),
    ("embedding of nothing", "/v1/embeddings", body({"input": ""}), 400, "invalid_value"),
    ("token id out of vocab", "/v1/completions", body({**COMP, "prompt": [1, 10**7]}), 400, "invalid_value"),
    ("unknown model", "/v1/chat/completions", body({**CHAT, "model": "gpt-17"}), 404, "model_not_found"),
    ("prompt longer than context", "/v1/completions", body({**COMP, "prompt": "hello " * 5000}), 400,
     "context_length_exceeded"),
    ("stream wrong type", "/v1/completions", body({**COMP, "stream": "yes"}), 400, "invalid_type"),
]


@pytest.mark.parametrize("name,path,data,status,code", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_a_clear_error(server, name, path, data, status, code):
    got_status, got = post(server, path, data)
    assert got_status == status, got
    err = got["error"]
    assert err["code"] == code
    assert err["message"]
    assert err["type"]


def test_unknown_qos_class_lists_valid_names(server):
    status, got = post(server, "/v1/completions", body(COMP), {"x-superfluid-qos": "urgent"})
    assert status == 400
    assert got["error"]["code"] == "invalid_qos_class"
    assert "interactive" in got["error"]["message"] and "background" in got["error"]["message"]


def test_unknown_route_and_method_are_json(server):
    status, got = post(server, "/v1/nope", body(COMP))
    assert status == 404 and got["error"]["message"]
    req = urllib.request.Request(server.base + "/v1/completions", method="GET")
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(req, timeout=10)
    assert info.value.code == 405
    assert json.loads(info.value.read())["error"]["code"] == "method_not_allowed"


def test_server_unharmed_after_bad_input(server, client):
    for _, path, data, _, _ in CASES:
        post(server, path, data)
    r = client.completions.create(model="smollm2", prompt="The capital of France is", max_tokens=6, temperature=0)
    assert "Paris" in r.choices[0].text
    health = server.get_json("/health")
    assert health["status"] == "ok"
    slots = server.get_json("/slots")["models"]["smollm2"]
    assert all(s["state"] == "free" for s in slots["slots"]) and slots["queued"] == 0


def test_infill_n_predict_error_names_n_predict(server):
    """llama.cpp's spelling of max_tokens: its errors name it, not the field it stands for."""
    status, got = post(server, "/infill", body({"input_prefix": "a", "input_suffix": "b", "n_predict": -7}))
    assert status == 400 and got["error"]["param"] == "n_predict", got
