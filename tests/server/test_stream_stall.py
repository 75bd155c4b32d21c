"""A client that stops reading a stream, against the real server: after --stream-stall-timeout its
lane is cancelled and freed, the daemon logs it, and a reading client beside it is unaffected.
Before the guard, such a lane decoded to max_tokens into the daemon's memory for nobody."""

from __future__ import annotations

import json
import re
import socket
import time

import httpx

STALL_S = 2.0


def _stuck_stream(port: int, max_tokens: int) -> socket.socket:
    """A streamed completion whose client never reads (a 4 KiB receive buffer fills at once)."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect(("127.0.0.1", port))
    body = json.dumps({"model": "smollm2", "prompt": "Tell a long story:", "max_tokens": max_tokens,
                       "ignore_eos": True, "stream": True, "logprobs": 5}).encode()  # ~1 KB a token
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n" % len(body) + body)
    return s


def _busy(srv) -> list[dict]:
    return [s for s in srv.get_json("/slots")["models"]["smollm2"]["slots"] if s.get("state") != "free"]


def test_a_stream_nobody_reads_is_cancelled_and_its_lane_freed(start_server):
    srv = start_server("--max-batch", "2", "--stream-stall-timeout", str(STALL_S))
    stuck = _stuck_stream(srv.port, 1900)
    try:
        deadline = time.monotonic() + 120
        while not _busy(srv) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _busy(srv), "the stuck stream never started"
        # a reader beside it is served whole meanwhile
        r = httpx.post(srv.base + "/v1/completions", json={"model": "smollm2", "prompt": "Hi", "max_tokens": 8},
                       timeout=120)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
        while _busy(srv) and time.monotonic() < deadline:
            time.sleep(0.2)
        busy = _busy(srv)
        assert not busy, f"the stalled stream still holds a lane: {busy}"
        log = srv.log_path.read_text()
        assert "read nothing for 2 s (--stream-stall-timeout)" in log
        stalled = [line for line in log.splitlines() if '" 499 ' in line and "finish=stalled" in line]
        assert stalled, "no access-log line for the stalled stream"
        # it names the tokens made before the stall (what the key was charged), not 0
        made = int(re.search(r"completion=(\d+)", stalled[0]).group(1))
        assert made > 0, stalled[0]
        metrics = httpx.get(srv.base + "/metrics", timeout=10).text
        assert 'finish_reason="cancelled"' in metrics
    finally:
        stuck.close()
    # the server goes on serving
    r = httpx.post(srv.base + "/v1/completions", json={"model": "smollm2", "prompt": "Hi", "max_tokens": 4},
                   timeout=120)
    assert r.status_code == 200
