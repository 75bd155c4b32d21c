"""Input limits (issue 17) against the real server and model: every limit answers a clear
OpenAI-style 4xx, slow clients are cut off, a full queue is a 429 with Retry-After, and a normal
chat is served meanwhile."""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest

CHAT = {"model": "smollm2", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0}
HEADER_TIMEOUT = 2.0
BODY_TIMEOUT = 2.0


@pytest.fixture(scope="module")
def limited(start_server):
    return start_server("--max-batch", "1", "--max-queue", "1", "--max-body-mb", "1", "--max-messages", "8",
                        "--max-stop", "4", "--max-tools", "2", "--max-header-kb", "8",
                        "--header-timeout", str(HEADER_TIMEOUT), "--body-timeout", str(BODY_TIMEOUT),
                        "--keepalive-timeout", "5")


def post(server, path: str, data: bytes, headers: dict | None = None, timeout: float = 60):
    """(status, JSON body, headers); an error status is returned, not raised."""
    req = urllib.request.Request(server.base + path, data=data, method="POST",
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read()), r.headers
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read()), e.headers


def chat(server, **extra):
    return post(server, "/v1/chat/completions", json.dumps({**CHAT, **extra}).encode())


def assert_error(body: dict, code: str, param=None):
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, body
    assert err["code"] == code, body
    assert err["param"] == param, body


def test_a_body_over_the_limit_is_413(limited):
    big = json.dumps({**CHAT, "messages": [{"role": "user", "content": "x" * (1 << 20)}]}).encode()
    status, body, _ = post(limited, "/v1/chat/completions", big)
    assert status == 413
    assert_error(body, "request_too_large")
    assert "--max-body-mb" in body["error"]["message"]
    assert chat(limited)[0] == 200


@pytest.mark.parametrize("field,value", [
    ("messages", [{"role": "user", "content": "hi"}] * 9),
    ("stop", ["a", "b", "c", "d", "e"]),
    ("tools", [{"type": "function", "function": {"name": f"f{i}", "parameters": {"type": "object"}}}
               for i in range(3)]),
])
def test_too_many_entries_is_400_naming_the_field(limited, field, value):
    status, body, _ = chat(limited, **{field: value})
    assert status == 400
    assert_error(body, "array_above_max_length", field)
    status, _, _ = chat(limited, **{field: value[:-1] if field != "messages" else value[:8]})
    assert status == 200


def test_a_huge_header_is_431(limited):
    status, body, _ = post(limited, "/v1/chat/completions", json.dumps(CHAT).encode(),
                           headers={"X-Padding": "p" * (9 << 10)})
    assert status == 431
    assert body["error"]["code"] == "request_header_too_large"
    status, body, _ = post(limited, "/v1/chat/completions", json.dumps(CHAT).encode(),
                           headers={f"X-Pad-{i}": "p" * 1000 for i in range(10)})  # 10 KiB in 10 lines
    assert status == 431
    assert chat(limited)[0] == 200


def _closed_after(sock: socket.socket, limit: float) -> tuple[float, bytes]:
    """(seconds until the server closed the connection, what it sent before)."""
    sock.settimeout(limit)
    t0, got = time.monotonic(), b""
    try:
        while chunk := sock.recv(65536):
            got += chunk
    except ConnectionResetError:
        pass
    return time.monotonic() - t0, got


def test_half_a_request_head_is_closed_after_the_header_timeout(limited):
    slow = [socket.create_connection(("127.0.0.1", limited.port)) for _ in range(20)]
    try:
        for s in slow:
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: appl")
        t0 = time.monotonic()
        assert chat(limited)[0] == 200                      # served while they hang
        waited, got = _closed_after(slow[0], HEADER_TIMEOUT + 5)
        assert time.monotonic() - t0 < HEADER_TIMEOUT + 4
        assert got.startswith(b"HTTP/1.1 408"), got
        assert b'"request_timeout"' in got
        for s in slow[1:]:
            _, got = _closed_after(s, 3)
            assert got.startswith(b"HTTP/1.1 408")
    finally:
        for s in slow:
            s.close()


def test_a_connection_that_sends_nothing_is_closed(limited):
    with socket.create_connection(("127.0.0.1", limited.port)) as s:
        waited, got = _closed_after(s, HEADER_TIMEOUT + 5)
        assert waited < HEADER_TIMEOUT + 3
        assert got == b"" or got.startswith(b"HTTP/1.1 408")


def test_a_body_sent_too_slowly_is_408(limited):
    with socket.create_connection(("127.0.0.1", limited.port)) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 1000\r\n\r\n{\"model\": ")
        t0 = time.monotonic()
        s.settimeout(BODY_TIMEOUT + 5)
        got = s.recv(65536)
        assert BODY_TIMEOUT - 0.5 <= time.monotonic() - t0 < BODY_TIMEOUT + 3
        assert got.startswith(b"HTTP/1.1 408"), got
        head, _, body = got.partition(b"\r\n\r\n")
        assert json.loads(body)["error"]["code"] == "request_timeout"
    assert chat(limited)[0] == 200


def _queued(server) -> int:
    return server.get_json("/slots")["models"]["smollm2"]["queued"]


def _busy(server) -> int:
    return server.get_json("/health")["models"]["smollm2"]["lanes_busy"]


def test_a_full_queue_is_429_with_retry_after(limited):
    results: dict[str, tuple] = {}
    long = {"max_tokens": 300, "ignore_eos": True}

    def run(name, headers=None, **extra):
        results[name] = post(limited, "/v1/chat/completions", json.dumps({**CHAT, **extra}).encode(),
                             headers=headers, timeout=240)

    first = threading.Thread(target=run, args=("first",), kwargs=long)
    first.start()
    deadline = time.monotonic() + 30
    while _busy(limited) == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    second = threading.Thread(target=run, args=("second",), kwargs=long)
    second.start()
    while _queued(limited) == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _queued(limited) == 1
    status, body, headers = chat(limited)                # the third: the agent queue holds 1 already
    assert status == 429, body
    assert_error(body, "queue_full")
    assert body["error"]["type"] == "rate_limit_error"
    assert headers["Retry-After"] == "1"
    other = threading.Thread(target=run, args=("other", {"x-superfluid-qos": "background"}))
    other.start()                                        # another class's queue has room
    for t in (first, second, other):
        t.join(240)
    assert results["other"][0] == 200
    for name in ("first", "second"):                     # nothing else changed
        status, body, _ = results[name]
        assert status == 200 and body["choices"][0]["finish_reason"] == "length"
        assert body["usage"]["completion_tokens"] == 300
    assert chat(limited)[0] == 200
