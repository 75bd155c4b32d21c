"""A model configured embedding-only in TOML, beside a generative one on the same server: it
serves /v1/embeddings, refuses chat and completions with a 400 naming it, and its embeddings
equal the generative model's for the same text (same weights, same pooling)."""

from __future__ import annotations

import math

import pytest

from .serverproc import ServerProcess


@pytest.fixture(scope="module")
def two_models(tmp_path_factory, model_path):
    tmp = tmp_path_factory.mktemp("embedding-only")
    cfg = tmp / "superfluid.toml"
    cfg.write_text(f'''
max-batch = 2
max-context = 512

[[models]]
name = "chat"
path = "{model_path}"

[[models]]
name = "embed"
path = "{model_path}"
embedding-only = true
''')
    srv = ServerProcess(["--config", str(cfg)], tmp / "server.log")
    yield srv
    srv.stop()


def test_embedding_only_model_refuses_generation_by_name(two_models):
    for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                       ("/v1/completions", {"prompt": "hi"})):
        status, reply = two_models.call("POST", path, {"model": "embed", "max_tokens": 4, **body})
        assert status == 400, reply
        err = reply["error"]
        assert err["code"] == "model_not_generative" and "embed" in err["message"] and err["param"] == "model"
    status, reply = two_models.call("POST", "/v1/chat/completions", {
        "model": "chat", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
    assert status == 200, reply  # the other model still generates


def test_embedding_only_model_embeds_as_the_generative_one(two_models):
    text = "Embeddings are pooled hidden states."
    got = {}
    for name in ("chat", "embed"):
        status, reply = two_models.call("POST", "/v1/embeddings", {"model": name, "input": text})
        assert status == 200, reply
        got[name] = reply["data"][0]["embedding"]
        assert reply["usage"]["prompt_tokens"] > 0
    a, b = got["chat"], got["embed"]
    assert len(a) == len(b) == 576
    assert abs(math.sqrt(sum(x * x for x in b)) - 1.0) < 1e-4
    assert max(abs(x - y) for x, y in zip(a, b)) < 1e-4
