"""A client that goes away frees its lane at the engine's next step."""

from __future__ import annotations

import http.client
import json
import time

LONG = {"model": "smollm2", "prompt": "Write a very long story about a dragon.", "max_tokens": 1500,
        "ignore_eos": True, "temperature": 0}


def _busy_slots(server):
    return [s for s in server.get_json("/slots")["models"]["smollm2"]["slots"] if s["state"] != "free"]


def _wait_free(server, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not _busy_slots(server):
            return time.monotonic()
        time.sleep(0.05)
    raise AssertionError(f"lanes still busy: {_busy_slots(server)}")


def _cancelled(server):
    return server.metrics().get('superfluid_requests_total{finish_reason="cancelled",model="smollm2"}', 0.0)


def test_disconnect_mid_stream_frees_lane(server):
    before = _cancelled(server)
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    conn.request("POST", "/v1/completions", body=json.dumps({**LONG, "stream": True}),
                 headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    chunks = 0
    while chunks < 5:
        line = resp.fp.readline()
        if line.startswith(b"data: {"):
            chunks += 1
    assert len(_busy_slots(server)) == 1
    closed_at = time.monotonic()
    conn.sock.close()
    conn.close()
    freed_at = _wait_free(server)
    assert freed_at - closed_at < 5.0
    assert _cancelled(server) == before + 1
    kv = server.get_json("/slots")["models"]["smollm2"]
    assert kv["queued"] == 0


def test_disconnect_while_waiting_non_streamed(server, client):
    before = _cancelled(server)
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    conn.request("POST", "/v1/completions", body=json.dumps(LONG), headers={"Content-Type": "application/json"})
    deadline = time.monotonic() + 10
    while not _busy_slots(server) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _busy_slots(server)
    conn.sock.close()
    conn.close()
    _wait_free(server)
    assert _cancelled(server) == before + 1
    r = client.completions.create(model="smollm2", prompt="The capital of France is", max_tokens=6, temperature=0)
    assert "Paris" in r.choices[0].text
