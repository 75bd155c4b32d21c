"""POST /tokenize and /detokenize (llama-server's shapes) and GET /v1/models/{id}, against the
real server and model; a key's model allow-list applies to the tokenizer routes too."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from superfluid.plugins.http.keys.policy import hash_secret


def test_tokenize_detokenize_round_trip(server):
    text = "The quick brown fox jumps over the lazy dog."
    status, body = server.call("POST", "/tokenize", {"content": text})
    assert status == 200 and set(body) == {"tokens"}
    tokens = body["tokens"]
    assert tokens and all(isinstance(t, int) for t in tokens)
    status, back = server.call("POST", "/detokenize", {"tokens": tokens})
    assert status == 200 and back == {"content": text}


def test_tokenize_matches_completion_usage(server):
    """The same tokenizer the generation routes use: a completion's prompt of these ids is these tokens."""
    tokens = server.call("POST", "/tokenize", {"content": "Hello there", "model": "smollm2"})[1]["tokens"]
    status, reply = server.call("POST", "/v1/completions", {"prompt": tokens, "max_tokens": 1, "temperature": 0})
    assert status == 200 and reply["usage"]["prompt_tokens"] == len(tokens)


def test_pieces_of_a_multibyte_string(server):
    text = "héllo 🙂"
    status, body = server.call("POST", "/tokenize", {"content": text, "with_pieces": True})
    assert status == 200
    pieces = body["tokens"]
    assert pieces and all(set(p) == {"id", "piece"} for p in pieces)
    plain = server.call("POST", "/tokenize", {"content": text})[1]["tokens"]
    assert [p["id"] for p in pieces] == plain
    data = b""
    for p in pieces:
        if isinstance(p["piece"], str):
            data += p["piece"].encode("utf-8")
        else:  # a token holding part of a character: its bytes
            assert all(isinstance(b, int) and 0 <= b < 256 for b in p["piece"])
            assert p["piece"], p
            data += bytes(p["piece"])
    assert data.decode("utf-8") == text
    assert any(isinstance(p["piece"], str) and "h" in p["piece"] for p in pieces)


def test_special_tokens(server):
    # parse_special (default true): ChatML markup is one token; false: it is plain text
    special = server.call("POST", "/tokenize", {"content": "<|im_start|>"})[1]["tokens"]
    plain = server.call("POST", "/tokenize", {"content": "<|im_start|>", "parse_special": False})[1]["tokens"]
    assert len(special) == 1 and len(plain) > 1
    # add_special adds the model's BOS only if it has one (SmolLM2 does not): never fewer tokens
    added = server.call("POST", "/tokenize", {"content": "hi", "add_special": True})[1]["tokens"]
    bare = server.call("POST", "/tokenize", {"content": "hi"})[1]["tokens"]
    assert added[-len(bare):] == bare
    assert server.call("POST", "/tokenize", {"content": ""}) == (200, {"tokens": []})
    assert server.call("POST", "/detokenize", {"tokens": []}) == (200, {"content": ""})


@pytest.mark.parametrize("path, body, param", [
    ("/tokenize", {}, "content"),
    ("/tokenize", {"content": 5}, "content"),
    ("/tokenize", {"content": "x", "with_pieces": "yes"}, "with_pieces"),
    ("/tokenize", {"content": "x", "extra": 1}, "extra"),
    ("/tokenize", {"content": "x", "model": 3}, "model"),
    ("/detokenize", {}, "tokens"),
    ("/detokenize", {"tokens": "1 2"}, "tokens"),
    ("/detokenize", {"tokens": [1, True]}, "tokens"),
    ("/detokenize", {"tokens": [-1]}, "tokens"),
    ("/detokenize", {"tokens": [10 ** 9]}, "tokens"),
])
def test_bad_bodies_are_400s(server, path, body, param):
    status, reply = server.call("POST", path, body)
    assert status == 400, reply
    assert reply["error"]["param"] == param and reply["error"]["type"] == "invalid_request_error"


def test_unknown_model_is_404(server):
    status, reply = server.call("POST", "/tokenize", {"content": "x", "model": "nope"})
    assert status == 404 and reply["error"]["code"] == "model_not_found"


def test_get_one_model_is_its_list_entry(server):
    listed = {m["id"]: m for m in server.get_json("/v1/models")["data"]}
    assert server.get_json("/v1/models/smollm2") == listed["smollm2"]


def test_get_unknown_model_is_404(server):
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(server.base + "/v1/models/nope", timeout=10)
    assert err.value.code == 404
    body = json.loads(err.value.read())
    assert body["error"]["code"] == "model_not_found" and body["error"]["type"] == "invalid_request_error"
    assert "nope" in body["error"]["message"] and "smollm2" in body["error"]["message"]


def test_openai_client_retrieves_a_model(client):
    openai = pytest.importorskip("openai")
    model = client.models.retrieve("smollm2")
    assert model.id == "smollm2" and model.object == "model"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nope")


# ---- a key's model allow-list --------------------------------------------------------------

SECRET = "sk-tokenize-other"
POLICY = f"""
[keys.other]
sha256 = "{hash_secret(SECRET)}"
models = ["some-other-model"]
"""


@pytest.fixture(scope="module")
def keyed(start_server, tmp_path_factory):
    path = tmp_path_factory.mktemp("keys") / "keys.toml"
    path.write_text(POLICY)
    return start_server("--key-policy", str(path), "--max-batch", "2")


def _post(srv, path: str, body: dict, secret: str | None) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json"}
    if secret:
        headers["Authorization"] = f"Bearer {secret}"
    req = urllib.request.Request(srv.base + path, data=json.dumps(body).encode(), method="POST", headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


@pytest.mark.parametrize("path, body", [("/tokenize", {"content": "hi"}), ("/detokenize", {"tokens": [1]})])
def test_key_policy_applies(keyed, path, body):
    status, reply = _post(keyed, path, body, None)
    assert status == 401 and reply["error"]["code"] == "invalid_api_key"
    status, reply = _post(keyed, path, body, SECRET)
    assert status == 403 and reply["error"]["code"] == "model_not_allowed"
