"""Model aliases and per-route metrics against the real server: an alias is served by its model
at its class, /v1/models lists it with the context window, a header still wins, and /metrics
counts each route's requests by pattern and status."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest


@pytest.fixture(scope="module")
def srv(start_server):
    return start_server("--model-alias", "side=smollm2@background", "--model-alias", "plain=smollm2")


def chat(srv, model, headers=None):
    body = {"model": model, "max_tokens": 2, "temperature": 0, "messages": [{"role": "user", "content": "Hi"}]}
    req = urllib.request.Request(srv.base + "/v1/chat/completions", data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read()), dict(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read()), dict(e.headers)


def test_models_lists_aliases_with_the_context_window(srv):
    listed = {m["id"]: m for m in srv.get_json("/v1/models")["data"]}
    assert set(listed) == {"smollm2", "side", "plain"}
    for entry in listed.values():
        assert entry["context_length"] == entry["context_window"] == entry["max_input_tokens"] == 2048
    assert listed["side"]["meta"]["alias_of"] == "smollm2" and listed["side"]["meta"]["qos"] == "background"
    assert srv.get_json("/v1/models/side")["id"] == "side"


def test_an_alias_runs_on_its_model_at_its_class(srv):
    status, body, headers = chat(srv, "side")
    assert status == 200, body
    assert headers["x-superfluid-qos"] == "background"
    status, body, headers = chat(srv, "plain")
    assert status == 200 and headers["x-superfluid-qos"] == "agent"  # no class of its own: the default
    status, body, headers = chat(srv, "side", {"x-superfluid-qos": "interactive"})
    assert status == 200 and headers["x-superfluid-qos"] == "interactive"  # what the request asks wins


def test_metrics_count_requests_by_route_pattern_and_status(srv):
    def count(route, status, method="POST"):
        key = f'superfluid_http_requests_total{{method="{method}",route="{route}",status="{status}"}}'
        return srv.metrics().get(key, 0)

    ok, missing = count("/v1/chat/completions", 200), count("/v1/chat/completions", 404)
    chat(srv, "side")
    chat(srv, "nope")
    assert count("/v1/chat/completions", 200) == ok + 1
    assert count("/v1/chat/completions", 404) == missing + 1
    nowhere = count("(no route)", 404, "GET")
    try:
        urllib.request.urlopen(srv.base + "/v1/no-such-route", timeout=10)
    except urllib.error.HTTPError as e:
        assert e.code == 404
    assert count("(no route)", 404, "GET") == nowhere + 1
    assert "no route serves this path" in srv.log()
