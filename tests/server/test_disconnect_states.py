"""A client that goes away frees everything its request held, whatever state it was in: queued,
prefilling, decoding or parked (preempted with its KV in host memory). Real server and model."""

from __future__ import annotations

import http.client
import json
import time

import pytest

LONG_PROMPT = "Here is a long list of facts about rivers and the sea. " * 100  # ~1.3k tokens


def open_stream(srv, prompt: str, qos: str = "agent", max_tokens: int = 600) -> http.client.HTTPConnection:
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=60)
    body = {"model": "smollm2", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": 0, "stream": True}
    conn.request("POST", "/v1/completions", body=json.dumps(body),
                 headers={"Content-Type": "application/json", "x-superfluid-qos": qos})
    return conn


def hang_up(conn: http.client.HTTPConnection) -> None:
    conn.sock.close()
    conn.close()


def snapshot(srv) -> dict:
    return srv.get_json("/slots")["models"]["smollm2"]


def wait_for(srv, check, what: str, timeout: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        snap = snapshot(srv)
        if check(snap):
            return snap
        time.sleep(0.03)
    raise AssertionError(f"timed out waiting for {what}: {snapshot(srv)}")


def busy(snap: dict) -> list[dict]:
    """The slots a lane holds (the others, spare KV buffers included, are free)."""
    return [s for s in snap["slots"] if s["state"] != "free"]


def states(snap: dict) -> list[str]:
    return [s["state"] for s in busy(snap)]


def released(snap: dict) -> bool:
    """No lane, no queue, no parked KV; KV cells in use only as evictable cached prefixes."""
    return (states(snap) == [] and snap["queued"] == 0 and snap["parked_bytes"] == 0
            and snap["kv_used"] <= snap["kv_cached"])


def cancelled(srv) -> float:
    return srv.metrics().get('superfluid_requests_total{finish_reason="cancelled",model="smollm2"}', 0.0)


@pytest.fixture(scope="module")
def srv(start_server):
    # One lane, so a second request queues; a small prefill budget, so a long prompt prefills for
    # many ticks; parking on, so a preempted lane holds KV in host memory.
    return start_server("--max-batch", "1", "--prefill-budget", "64", "--park")


def test_disconnect_while_prefilling(srv):
    before = cancelled(srv)
    conn = open_stream(srv, LONG_PROMPT)
    wait_for(srv, lambda s: states(s) == ["prefilling"], "prefill")
    hang_up(conn)
    wait_for(srv, released, "release after a disconnect in prefill")
    assert cancelled(srv) == before + 1


def test_disconnect_while_decoding(srv):
    conn = open_stream(srv, "Tell me a story.")
    wait_for(srv, lambda s: states(s) == ["decoding"], "decode")
    hang_up(conn)
    wait_for(srv, released, "release after a disconnect in decode")


def test_disconnect_while_queued(srv):
    running = open_stream(srv, "Tell me a story.", max_tokens=300)
    wait_for(srv, lambda s: states(s) == ["decoding"], "the first lane")
    queued = open_stream(srv, "Tell me another story.")
    wait_for(srv, lambda s: s["queued"] == 1, "the second request to queue")
    hang_up(queued)
    snap = wait_for(srv, lambda s: s["queued"] == 0, "the queue to empty")
    assert states(snap) == ["decoding"]  # the running request goes on
    resp = running.getresponse()
    assert resp.status == 200 and b"[DONE]" in resp.read()
    wait_for(srv, released, "release after the first request")


def test_disconnect_while_parked(srv):
    background = open_stream(srv, LONG_PROMPT[:2000], qos="background")
    wait_for(srv, lambda s: states(s) == ["decoding"], "the background lane to decode")
    urgent = open_stream(srv, "Hi!", qos="interactive", max_tokens=400)
    snap = wait_for(srv, lambda s: s["queue"] and s["queue"][0]["parked"] and s["parked_bytes"] > 0,
                    "the background lane to be preempted and parked")
    assert busy(snap)[0]["qos"] == "interactive"
    hang_up(background)
    snap = wait_for(srv, lambda s: s["queued"] == 0 and s["parked_bytes"] == 0, "the parked KV to be dropped")
    assert busy(snap)[0]["qos"] == "interactive"  # dropped while parked, not after resuming
    hang_up(urgent)
    wait_for(srv, released, "release after both")
