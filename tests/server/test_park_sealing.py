"""Sealing with --park: a session's finished turn writes its KV to the state dir, so a daemon
SIGKILLed afterwards (no shutdown, nothing persisted then) still restores the session warm. Without
--park nothing is sealed; a truncated artifact is refused and the turn is served cold."""

from __future__ import annotations

import json
import os
import signal
import time

import psutil
import pytest

from .serverproc import still_running

SYSTEM = ("You are a careful assistant for a library. Answer briefly and politely. " * 6).strip()


def turn(srv, sid: str, text: str) -> dict:
    status, body = srv.call("POST", f"/v1/sessions/{sid}/turns",
                            {"messages": [{"role": "user", "content": text}], "max_tokens": 12,
                             "temperature": 0})
    assert status == 200, body
    return body


def session(srv) -> str:
    status, body = srv.call("POST", "/v1/sessions", {"system": SYSTEM})
    assert status == 201, body
    return body["id"]


def wait_sealed(state, sid: str, turns: int, timeout: float = 30.0) -> dict:
    """The park artifact's metadata once it names ``turns`` (written after the KV file is in place)."""
    meta = state / "park" / f"{sid}.json"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            got = json.loads(meta.read_text())
            if got.get("turns") == turns:
                assert (state / "park" / f"{sid}.kv").stat().st_size > 0
                return got
        except (OSError, ValueError):
            pass
        time.sleep(0.05)
    pytest.fail(f"turn {turns} of {sid} was not sealed in {timeout} s")


def sigkill(srv) -> None:
    """SIGKILL the daemon's process group: no shutdown runs; its engine worker dies with it."""
    held = [psutil.Process(srv.proc.pid), *psutil.Process(srv.proc.pid).children(recursive=True)]
    os.killpg(srv.proc.pid, signal.SIGKILL)
    srv.proc.wait(10)
    alive = still_running(held)
    assert not alive, f"left running after SIGKILL: {[p.pid for p in alive]}"


def cached(body: dict) -> int:
    return body["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_a_sealed_session_survives_sigkill_warm(start_server, tmp_path):
    state = tmp_path / "state"
    flags = ("--state-dir", str(state), "--park", "--max-batch", "2")
    srv = start_server(*flags)
    sid = session(srv)
    turn(srv, sid, "Where is the library?")
    wait_sealed(state, sid, 1)
    second = turn(srv, sid, "Is parking free?")
    assert cached(second) >= 1
    meta = wait_sealed(state, sid, 2)  # the artifact follows the latest turn
    assert len(meta["tokens"]) > second["usage"]["prompt_tokens"]  # its prompt and its reply
    # a stored response is a session turn too: sealed the same way
    status, first = srv.call("POST", "/v1/responses", {"model": "smollm2", "store": True,
                                                       "input": SYSTEM + " Do you lend films?", "max_output_tokens": 12,
                                                       "temperature": 0})
    assert status == 200, first
    deadline = time.monotonic() + 30
    while not (chained := [p for p in (state / "park").glob("*.json") if p.stem != sid]):
        assert time.monotonic() < deadline, "the stored response was not sealed"
        time.sleep(0.05)
    wait_sealed(state, chained[0].stem, 1)
    assert srv.settled_metric("superfluid_seal_seconds_count") >= 3
    assert "persisted" not in srv.log()
    sigkill(srv)

    srv = start_server(*flags)
    status, shown = srv.call("GET", f"/v1/sessions/{sid}")
    assert status == 200 and shown["turns"] == 2 and shown["state"] == "parked", shown
    third = turn(srv, sid, "Thank you.")
    assert cached(third) >= second["usage"]["prompt_tokens"], third["usage"]
    status, then = srv.call("POST", "/v1/responses", {"model": "smollm2", "previous_response_id": first["id"],
                                                      "store": True, "input": "And music?", "max_output_tokens": 12,
                                                      "temperature": 0})
    assert status == 200, then
    assert then["usage"]["input_tokens_details"]["cached_tokens"] >= first["usage"]["input_tokens"], then["usage"]


def test_without_park_nothing_is_sealed(start_server, tmp_path):
    state = tmp_path / "state"
    flags = ("--state-dir", str(state), "--max-batch", "2")
    srv = start_server(*flags)
    sid = session(srv)
    first = turn(srv, sid, "Where is the library?")
    time.sleep(1.0)  # a seal, were there one, is written by the next tick
    assert not list((state / "park").glob(f"{sid}.*"))
    sigkill(srv)

    srv = start_server(*flags)
    second = turn(srv, sid, "Is parking free?")
    assert second["usage"]["prompt_tokens"] > first["usage"]["prompt_tokens"]
    assert cached(second) == 0, second["usage"]


def test_a_truncated_seal_is_refused_and_served_cold(start_server, tmp_path):
    state = tmp_path / "state"
    flags = ("--state-dir", str(state), "--park", "--max-batch", "2")
    srv = start_server(*flags)
    sid = session(srv)
    turn(srv, sid, "Where is the library?")
    wait_sealed(state, sid, 1)
    sigkill(srv)
    kv = state / "park" / f"{sid}.kv"
    kv.write_bytes(kv.read_bytes()[: kv.stat().st_size // 2])

    srv = start_server(*flags)
    second = turn(srv, sid, "Is parking free?")
    assert cached(second) == 0, second["usage"]
    assert "prefilling" in srv.log() or "unusable" in srv.log(), srv.log()
    assert turn(srv, sid, "Thank you.")["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
