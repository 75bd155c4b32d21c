"""SIGTERM drains: running requests finish, new ones get a clear 503, the daemon exits 0 in
bounded time. Real server and model."""

from __future__ import annotations

import json
import signal
import threading
import time
import urllib.error
import urllib.request

from .serverproc import ServerProcess


def server_and_stream(model_path, tmp_path, shutdown_timeout: int, max_tokens: int):
    """A fresh server of our own (this test stops it) and a streaming request to send it."""
    srv = ServerProcess(["--model", model_path, "--model-name", "smollm2", "--max-context", "2048",
                         "--shutdown-timeout", str(shutdown_timeout)], tmp_path / "server.log")
    body = json.dumps({"model": "smollm2", "prompt": "Once upon a time", "max_tokens": max_tokens,
                       "ignore_eos": True, "temperature": 0, "stream": True}).encode()
    return srv, urllib.request.Request(srv.base + "/v1/completions", data=body,
                                       headers={"Content-Type": "application/json"})


def test_sigterm_lets_running_requests_finish(model_path, tmp_path):
    srv, req = server_and_stream(model_path, tmp_path, shutdown_timeout=30, max_tokens=60)
    chunks = []
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            for line in r:
                if not line.startswith(b"data: {"):
                    continue
                chunks.append(json.loads(line[6:]))
                if len(chunks) == 3:
                    srv.proc.send_signal(signal.SIGTERM)
                    signalled = time.monotonic()
                    refused = _refused(srv)
        assert "error" not in chunks[-1], chunks[-1]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"  # the stream ran to its end
        text = "".join(c["choices"][0]["text"] for c in chunks)
        assert len(text) > 100, text
        assert refused == (503, "shutting_down")
        assert srv.proc.wait(40) == 0
        assert time.monotonic() - signalled < 40  # --shutdown-timeout bounds it (plus engine exit)
    finally:
        srv.stop()


def _refused(srv) -> tuple[int, str] | None:
    """What a new request gets while the daemon drains (asked from another thread)."""
    out = []

    def ask():
        data = json.dumps({"model": "smollm2", "prompt": "Hi", "max_tokens": 2}).encode()
        rq = urllib.request.Request(srv.base + "/v1/completions", data=data,
                                    headers={"Content-Type": "application/json"})
        time.sleep(0.3)
        try:
            urllib.request.urlopen(rq, timeout=10)
            out.append(None)
        except urllib.error.HTTPError as exc:
            out.append((exc.code, json.loads(exc.read())["error"]["code"]))

    t = threading.Thread(target=ask)
    t.start()
    t.join(15)
    return out[0] if out else None


def test_sigterm_bounds_the_wait(model_path, tmp_path):
    """A request that cannot finish within --shutdown-timeout ends with a clear error."""
    srv, req = server_and_stream(model_path, tmp_path, shutdown_timeout=2, max_tokens=1900)
    last = None
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            for n, line in enumerate(r):
                if n == 4:
                    srv.proc.send_signal(signal.SIGTERM)
                    signalled = time.monotonic()
                if line.startswith(b"data: {"):
                    last = json.loads(line[6:])
        assert last["error"]["code"] == "shutting_down", last
        assert srv.proc.wait(30) == 0
        assert time.monotonic() - signalled < 15
    finally:
        srv.stop()
