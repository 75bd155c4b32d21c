"""POST /v1/embeddings against the real server and model, through the openai client: floats and
base64 agree, vectors are unit length and deterministic, near-duplicates are closer than
unrelated texts, and bad requests are 400s naming the field."""

from __future__ import annotations

import base64
import concurrent.futures as cf
import http.client
import json
import math
import struct
import time
import urllib.error
import urllib.request

import pytest

from superfluid.plugins.http.keys.policy import hash_secret


def _embed(client, texts, **kw):
    return client.embeddings.create(model="smollm2", input=texts, **kw)


def _cos(a, b) -> float:
    return sum(x * y for x, y in zip(a, b)) / math.sqrt(sum(x * x for x in a) * sum(y * y for y in b))


def _width(server) -> int:
    status, reply = server.call("POST", "/v1/embeddings", {"input": "x"})
    assert status == 200, reply
    return len(reply["data"][0]["embedding"])


def test_float_embeddings_are_unit_vectors(client):
    r = _embed(client, "The cat sat on the mat.", encoding_format="float")
    assert r.object == "list" and r.model == "smollm2" and len(r.data) == 1
    item = r.data[0]
    assert item.object == "embedding" and item.index == 0
    assert len(item.embedding) > 16 and all(isinstance(x, float) for x in item.embedding)
    assert math.isclose(math.sqrt(sum(x * x for x in item.embedding)), 1.0, rel_tol=1e-4)


def test_base64_matches_float(client, server):
    texts = ["first text", "a second, longer text about something else"]
    floats = _embed(client, texts, encoding_format="float")
    # the openai client decodes base64 itself: asked without a format, it asks for base64
    decoded = _embed(client, texts)
    status, raw = server.call("POST", "/v1/embeddings", {"input": texts, "encoding_format": "base64"})
    assert status == 200 and isinstance(raw["data"][0]["embedding"], str)
    for i in range(2):
        ours = raw["data"][i]["embedding"]
        data = base64.b64decode(ours)
        vec = struct.unpack(f"<{len(data) // 4}f", data)
        assert len(vec) == len(floats.data[i].embedding)
        assert all(math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-6) for a, b in zip(vec, floats.data[i].embedding))
        assert all(math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-6)
                   for a, b in zip(decoded.data[i].embedding, floats.data[i].embedding))


def test_same_text_same_vector_different_texts_differ(client):
    r = _embed(client, ["The weather is nice today.", "The weather is nice today.", "Quantum chromodynamics."],
               encoding_format="float")
    assert [d.index for d in r.data] == [0, 1, 2]
    a, b, c = (d.embedding for d in r.data)
    assert _cos(a, b) > 0.9999
    assert _cos(a, c) < 0.999
    again = _embed(client, "The weather is nice today.", encoding_format="float").data[0].embedding
    assert _cos(a, again) > 0.9999  # alone or in a batch: the same vector


def test_near_duplicates_are_closer_than_unrelated(client):
    r = _embed(client, ["I love eating pizza with my friends on Friday night.",
                        "I love eating pizza with my friends on Saturday night.",
                        "The stock market fell sharply after the central bank raised interest rates."],
               encoding_format="float")
    a, b, c = (d.embedding for d in r.data)
    assert _cos(a, b) > _cos(a, c)
    assert _cos(a, b) > _cos(b, c)


def test_token_id_inputs_match_text(client, server):
    text = "Hello world, this is a test."
    tokens = server.call("POST", "/tokenize", {"content": text, "add_special": True})[1]["tokens"]
    by_text = _embed(client, text, encoding_format="float")
    by_ids = _embed(client, tokens, encoding_format="float")
    by_lists = _embed(client, [tokens, tokens], encoding_format="float")
    assert _cos(by_text.data[0].embedding, by_ids.data[0].embedding) > 0.9999
    assert len(by_lists.data) == 2
    assert by_ids.usage.prompt_tokens == len(tokens)


def test_usage_counts_tokens(client, server):
    texts = ["one", "two words", "and now three words"]
    r = _embed(client, texts, encoding_format="float")
    counts = [len(server.call("POST", "/tokenize", {"content": t, "add_special": True, "parse_special": False})[1]
                  ["tokens"]) for t in texts]
    assert r.usage.prompt_tokens == sum(counts) == r.usage.total_tokens


def test_dimensions(client, server):
    width = _width(server)
    r = _embed(client, "hi", dimensions=width, encoding_format="float")
    assert len(r.data[0].embedding) == width
    openai = pytest.importorskip("openai")
    with pytest.raises(openai.BadRequestError) as err:
        _embed(client, "hi", dimensions=width // 2)
    assert err.value.body["param"] == "dimensions"


def test_many_inputs_in_order(client):
    texts = [f"sentence number {i}" for i in range(12)]  # more than the server's 8 lanes: two windows
    r = _embed(client, texts, encoding_format="float")
    assert [d.index for d in r.data] == list(range(12))
    single = _embed(client, texts[10], encoding_format="float").data[0].embedding
    assert _cos(r.data[10].embedding, single) > 0.9999


def test_concurrent_requests(server):
    def one(i):
        return server.call("POST", "/v1/embeddings", {"input": [f"text {i}", f"other {i}"]})
    with cf.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, range(8)))
    assert all(status == 200 and len(body["data"]) == 2 for status, body in results)


@pytest.mark.parametrize("body, param", [
    ({"input": ""}, "input"),
    ({"input": []}, "input"),
    ({"input": ["ok", ""]}, "input"),
    ({"input": [[1, 2], []]}, "input"),
    ({"input": ["text", [1, 2]]}, "input"),
    ({"input": 5}, "input"),
    ({}, "input"),
    ({"input": ["x"] * 2049}, "input"),
    ({"input": [10 ** 9]}, "input"),
    ({"input": [-1]}, "input"),
    ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
    ({"input": "x", "dimensions": 3}, "dimensions"),
    ({"input": "x", "dimensions": "3"}, "dimensions"),
    ({"input": "x", "user": 5}, "user"),
    ({"input": "x", "model": 5}, "model"),
    ({"input": "x", "temperature": 0}, "temperature"),
])
def test_bad_requests_are_400s(server, body, param):
    status, reply = server.call("POST", "/v1/embeddings", body)
    assert status == 400, reply
    assert reply["error"]["param"] == param and reply["error"]["type"] == "invalid_request_error", reply


def test_user_is_accepted(server):
    status, reply = server.call("POST", "/v1/embeddings", {"input": "x", "user": "someone"})
    assert status == 200, reply


def test_empty_input_through_the_client(client):
    openai = pytest.importorskip("openai")
    with pytest.raises(openai.BadRequestError):
        _embed(client, "")


def test_unknown_model_is_404(server):
    status, reply = server.call("POST", "/v1/embeddings", {"input": "x", "model": "nope"})
    assert status == 404 and reply["error"]["code"] == "model_not_found"


def test_input_longer_than_the_context_is_400(start_server):
    srv = start_server("--max-batch", "2", "--max-context", "64")
    status, reply = srv.call("POST", "/v1/embeddings", {"input": ["short", "word " * 200]})
    assert status == 400 and reply["error"]["code"] == "context_length_exceeded", reply
    assert reply["error"]["param"] == "input" and "input[1]" in reply["error"]["message"]
    status, reply = srv.call("POST", "/v1/embeddings", {"input": "short"})  # the server is fine after
    assert status == 200, reply


def _busy(server) -> list:
    snap = server.get_json("/slots")["models"]["smollm2"]
    return [s for s in snap["slots"] if s["state"] != "free"] + ([None] * snap["queued"])


def test_client_leaving_cancels_its_lanes(server, client):
    """Inputs queued or running when the client goes away are cancelled, not computed for nobody."""
    body = {"input": [f"{i} " + "word " * 1500 for i in range(30)]}  # 30 long prefills, 8 at a time
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    conn.request("POST", "/v1/embeddings", body=json.dumps(body), headers={"Content-Type": "application/json"})
    deadline = time.monotonic() + 20
    while not _busy(server) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert _busy(server)
    conn.sock.close()
    conn.close()
    closed = time.monotonic()
    while _busy(server) and time.monotonic() < closed + 5:  # computing them all: over 15 s here
        time.sleep(0.05)
    assert not _busy(server), _busy(server)
    assert _embed(client, "still fine", encoding_format="float").data  # the server goes on


# ---- QoS and the key policy ----------------------------------------------------------------

SECRETS = {"agent": "sk-embed-agent", "other": "sk-embed-other", "one": "sk-embed-one-lane"}
POLICY = f"""
[keys.agent]
sha256 = "{hash_secret(SECRETS['agent'])}"
class = "agent"

[keys.other]
sha256 = "{hash_secret(SECRETS['other'])}"
models = ["some-other-model"]

[keys.one]
sha256 = "{hash_secret(SECRETS['one'])}"
requests-per-minute = 2
"""


@pytest.fixture(scope="module")
def keyed(start_server, tmp_path_factory):
    path = tmp_path_factory.mktemp("keys") / "keys.toml"
    path.write_text(POLICY)
    return start_server("--key-policy", str(path), "--max-batch", "2")


def _post(srv, body: dict, secret: str | None = None, headers: dict | None = None):
    hdrs = {"Content-Type": "application/json", **(headers or {})}
    if secret:
        hdrs["Authorization"] = f"Bearer {secret}"
    req = urllib.request.Request(srv.base + "/v1/embeddings", data=json.dumps(body).encode(), method="POST",
                                 headers=hdrs)
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, {k.lower(): v for k, v in r.headers.items()}, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, {k.lower(): v for k, v in exc.headers.items()}, json.loads(exc.read())


def test_qos_header_is_applied(server):
    status, headers, _ = _post(server, {"input": "x"}, headers={"x-superfluid-qos": "background"})
    assert status == 200 and headers["x-superfluid-qos"] == "background"


def test_body_field_class_is_applied(server):
    status, headers, _ = _post(server, {"input": "x", "superfluid": {"qos": "background"}},
                               headers={"x-superfluid-qos": "interactive"})
    assert status == 200 and headers["x-superfluid-qos"] == "background"  # the body wins
    status, _, err = _post(server, {"input": "x", "superfluid": {"qos": "soon"}})
    assert status == 400 and err["error"]["code"] == "invalid_qos_class"


def test_key_policy(keyed):
    assert _post(keyed, {"input": "x"})[0] == 401
    status, _, reply = _post(keyed, {"input": "x"}, SECRETS["other"])
    assert status == 403 and reply["error"]["code"] == "model_not_allowed"
    # the key's class is the ceiling: asking for interactive gets agent
    status, headers, _ = _post(keyed, {"input": "x"}, SECRETS["agent"], {"x-superfluid-qos": "interactive"})
    assert status == 200 and headers["x-superfluid-qos"] == "agent"


def test_key_limits_count_embeddings(keyed):
    statuses = [_post(keyed, {"input": "x"}, SECRETS["one"])[0] for _ in range(3)]
    assert statuses[:2] == [200, 200] and statuses[2] == 429
