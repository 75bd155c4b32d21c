"""The model-server protocol on a real node (the default model, one lane): what Kubernetes'
endpoint picker reads from /metrics, idle, the moment requests arrive, while a prompt is held, and
once they are gone; /v1/models in the shape it parses."""

from __future__ import annotations

import http.client
import json
import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from superfluid.plugins.http.info.model_server_metrics import CACHE_INFO, KV_USAGE, RUNNING, WAITING

MODEL = "smollm2"
PROMPT = " ".join(f"word{i}" for i in range(100))  # about 300 tokens: one lane holds them a while


@pytest.fixture(scope="module")
def node(start_server):
    return start_server("--max-batch", "1")


def scrape(node) -> dict[str, dict]:
    """{metric name: {"value": v, "labels": {...}}} of this model's series, from one GET /metrics."""
    with urllib.request.urlopen(node.base + "/metrics", timeout=10) as r:
        text = r.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in (WAITING, RUNNING, KV_USAGE, CACHE_INFO) and s.labels.get("model_name") == MODEL:
                out[s.name] = {"value": s.value, "labels": s.labels}
    return out


def values(node) -> tuple[float, float, float]:
    got = scrape(node)
    return got[WAITING]["value"], got[RUNNING]["value"], got[KV_USAGE]["value"]


def wait_for(node, check, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while True:
        got = values(node)
        if check(*got) or time.monotonic() > deadline:
            return got
        time.sleep(0.02)


def open_stream(node) -> http.client.HTTPConnection:
    conn = http.client.HTTPConnection("127.0.0.1", node.port, timeout=60)
    # ignore_eos: the lane stays busy until the client leaves, whatever the model would say
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 1500, "stream": True, "ignore_eos": True}
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    return conn


def test_idle_busy_and_idle_again(node):
    waiting, running, usage = values(node)
    assert (waiting, running) == (0, 0)
    assert 0 <= usage <= 1
    idle_usage = usage
    info = scrape(node)[CACHE_INFO]
    assert info["value"] == 1 and int(info["labels"]["block_size"]) > 0

    streams = [open_stream(node) for _ in range(3)]
    try:
        # the moment they arrive (before the first tick ends): one holds the lane, two wait
        assert wait_for(node, lambda w, r, u: (w, r) == (2, 1))[:2] == (2, 1)
        first = streams[0].getresponse()
        assert first.status == 200
        while not first.fp.readline().startswith(b"data:"):  # its prompt is in the KV now
            pass
        # the queue and the lanes are read live; the pool numbers as of the last tick's end, and the
        # token just read was streamed before its tick's stats reached the gauge: wait for them
        waiting, running, usage = wait_for(node, lambda w, r, u: u > idle_usage, timeout=10)
        assert (waiting, running) == (2, 1)
        assert idle_usage < usage <= 1, usage
        info = scrape(node)[CACHE_INFO]["labels"]
        # the pool's size is known after the first tick: block_size x num_gpu_blocks tokens
        assert int(info["num_gpu_blocks"]) * int(info["block_size"]) >= 300
    finally:
        for conn in streams:  # the clients leave: their requests are cancelled
            conn.close()
    waiting, running, usage = wait_for(node, lambda w, r, u: (w, r, u) == (0, 0, 0))
    assert (waiting, running) == (0, 0)
    assert usage == 0  # the prompt stays cached, but cached prefixes are free room


def test_v1_models_as_the_endpoint_picker_reads_it(node):
    body = node.get_json("/v1/models")
    assert body["object"] == "list"
    assert [m["id"] for m in body["data"]] == [MODEL]
    entry = body["data"][0]
    assert entry["object"] == "model" and isinstance(entry["created"], int) and entry["owned_by"]
