"""The session API against the real server and model: turns, SetQos, park, close, bad input,
and a daemon restart that serves the next turn from the park artifact."""

from __future__ import annotations

import os

import pytest

from .serverproc import ServerProcess

SYSTEM = ("You are a careful assistant for a library. Answer briefly and politely. " * 6).strip()


def call(srv, method: str, path: str, body: dict | None = None) -> tuple[int, dict]:
    return srv.call(method, path, body)


def turn(srv, sid: str, text: str, **extra) -> dict:
    status, body = call(srv, "POST", f"/v1/sessions/{sid}/turns",
                        {"messages": [{"role": "user", "content": text}], "max_tokens": 12,
                         "temperature": 0, **extra})
    assert status == 200, body
    return body


@pytest.fixture(scope="module")
def state_server(start_server, tmp_path_factory):
    state = tmp_path_factory.mktemp("state")
    return start_server("--state-dir", str(state), "--park", "--max-batch", "4"), state


def test_turns_keep_history_and_reuse_the_prefix(state_server):
    srv, _ = state_server
    status, session = call(srv, "POST", "/v1/sessions", {"system": SYSTEM, "qos": "interactive",
                                                         "pin_system": True})
    assert status == 201 and session["state"] == "open" and session["qos"] == "interactive"
    assert session["pin_system"] is True
    first = turn(srv, session["id"], "What are the opening hours?")
    second = turn(srv, session["id"], "And on Sundays?")
    # The second prompt holds the whole first turn: it is longer, and most of it came from cache.
    assert second["usage"]["prompt_tokens"] > first["usage"]["prompt_tokens"] + 5
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= first["usage"]["prompt_tokens"]
    status, shown = call(srv, "GET", f"/v1/sessions/{session['id']}")
    assert status == 200 and shown["turns"] == 2
    assert [m["role"] for m in shown["messages"]] == ["user", "assistant", "user", "assistant"]
    assert shown["messages"][1]["content"] == first["choices"][0]["message"]["content"]


def test_set_qos_park_resume_and_close(state_server):
    srv, state = state_server
    _, session = call(srv, "POST", "/v1/sessions", {"system": SYSTEM})
    sid = session["id"]
    turn(srv, sid, "Hello there.")
    status, changed = call(srv, "POST", f"/v1/sessions/{sid}/qos", {"qos": "background"})
    assert status == 200 and changed["qos"] == "background"
    status, parked = call(srv, "POST", f"/v1/sessions/{sid}/park")
    assert status == 200 and parked["state"] == "parked" and parked["parked_tokens"] > 0
    assert os.path.getsize(state / "park" / f"{sid}.kv") > 0
    resumed = turn(srv, sid, "Thanks!")  # a turn on a parked session resumes it
    assert resumed["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert call(srv, "GET", f"/v1/sessions/{sid}")[1]["state"] == "open"
    status, gone = call(srv, "DELETE", f"/v1/sessions/{sid}")
    assert status == 200 and gone["deleted"] is True
    status, err = call(srv, "POST", f"/v1/sessions/{sid}/turns", {"messages": [{"role": "user", "content": "x"}]})
    assert status == 409 and err["error"]["code"] == "session_closed"
    assert not (state / "park" / f"{sid}.kv").exists()


@pytest.mark.parametrize("method,path,body,status,param", [
    ("POST", "/v1/sessions/sess_nope/turns", {"messages": [{"role": "user", "content": "x"}]}, 404, "session_id"),
    ("GET", "/v1/sessions/sess_nope", None, 404, "session_id"),
    ("POST", "/v1/sessions", {"qos": "platinum"}, 400, "qos"),
    ("POST", "/v1/sessions", {"model": "nope"}, 404, "model"),
    ("POST", "/v1/sessions", {"colour": "red"}, 400, "colour"),
    ("POST", "/v1/sessions", {"system": 5}, 400, "system"),
    ("POST", "/v1/sessions", {"pin_system": True}, 400, "pin_system"),
    ("POST", "/v1/sessions", {"system": "x", "pin_system": "yes"}, 400, "pin_system"),
])
def test_bad_session_requests(state_server, method, path, body, status, param):
    srv, _ = state_server
    got, err = call(srv, method, path, body)
    assert got == status, err
    assert err["error"]["param"] == param


def test_bad_turn_body_changes_nothing(state_server):
    srv, _ = state_server
    _, session = call(srv, "POST", "/v1/sessions", {})
    for bad in ({"messages": []}, {"messages": [{"role": "user", "content": "x"}], "max_tokens": -1},
                {"messages": [{"role": "user", "content": "x"}], "model": "smollm2"}):
        status, err = call(srv, "POST", f"/v1/sessions/{session['id']}/turns", bad)
        assert status == 400, err
    assert call(srv, "GET", f"/v1/sessions/{session['id']}")[1]["turns"] == 0


def test_state_dir_not_writable_fails_at_startup(start_server, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(RuntimeError, match="state-dir"):
        start_server("--state-dir", str(blocker / "sub"))


def test_sessions_survive_a_restart(model_path, tmp_path):
    """SIGTERM persists the session's KV; the restarted daemon recovers the session and its next
    turn restores the park artifact instead of prefilling the conversation."""
    state = tmp_path / "state"
    args = ["--model", model_path, "--model-name", "smollm2", "--max-context", "2048",
            "--state-dir", str(state), "--park", "--max-batch", "2"]
    srv = ServerProcess(args, tmp_path / "first.log")
    try:
        sid, other = (call(srv, "POST", "/v1/sessions", {"system": SYSTEM})[1]["id"] for _ in range(2))
        for text in ("Where is the library?", "Is parking free?"):
            turn(srv, sid, text)
        turn(srv, other, "Do you lend films?")
    finally:
        assert srv.stop() == 0, srv.log()
    assert "persisted 2 sessions" in srv.log()
    # A damaged log and a truncated artifact are skipped with a warning, not fatal.
    (state / "sessions" / "sess_broken.jsonl").write_text('{"op": "turn"}\n{not json\n')
    kv = state / "park" / f"{other}.kv"
    kv.write_bytes(kv.read_bytes()[: kv.stat().st_size // 2])
    srv = ServerProcess(args, tmp_path / "second.log")
    try:
        damaged = turn(srv, other, "And music?")  # its artifact is unusable: it prefills again
        assert damaged["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        status, shown = call(srv, "GET", f"/v1/sessions/{sid}")
        assert status == 200 and shown["turns"] == 2 and shown["state"] == "parked"
        assert call(srv, "GET", "/v1/sessions/sess_broken")[0] == 404
        nxt = turn(srv, sid, "Thank you.")
        usage = nxt["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens"] > usage["prompt_tokens"] * 0.7, usage
        assert call(srv, "GET", f"/v1/sessions/{sid}")[1]["turns"] == 3
    finally:
        srv.stop()
    assert "skipped" in srv.log()


def test_a_reloaded_model_pins_and_restores_sessions_again(start_server, tmp_path):
    """Unloading a model drops its scheduler's pins and host tier. The next turn of an open
    session pins its system prompt in the new scheduler and takes its park artifact again."""
    srv = start_server("--state-dir", str(tmp_path / "state"), "--park", "--max-batch", "2")
    pins = lambda: srv.get_json("/slots")["models"]["smollm2"]["pinned_prefixes"]  # noqa: E731
    _, session = call(srv, "POST", "/v1/sessions", {"system": SYSTEM, "pin_system": True})
    sid = session["id"]
    assert pins() == 1
    turn(srv, sid, "What are the opening hours?")
    status, parked = call(srv, "POST", f"/v1/sessions/{sid}/park")
    assert status == 200 and parked["parked_tokens"] > 0
    turn(srv, sid, "And on Sundays?")  # resumed from the artifact in this scheduler
    assert call(srv, "POST", "/admin/models/smollm2/unload", {"drain_timeout_s": 1})[0] == 200
    assert call(srv, "POST", "/admin/models/smollm2/load")[0] == 200
    assert pins() == 0                  # a new scheduler: nothing pinned yet
    after = turn(srv, sid, "Thank you.")
    assert pins() == 1
    # The artifact held the first turn's prompt; the new engine restores it instead of prefilling.
    assert after["usage"]["prompt_tokens_details"]["cached_tokens"] >= parked["parked_tokens"] - 1, after["usage"]
    assert call(srv, "DELETE", f"/v1/sessions/{sid}")[0] == 200
    assert pins() == 0
