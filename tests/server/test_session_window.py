"""A session whose history outgrows the context: with --session-overflow truncate (the default) the
oldest messages leave the prompt (the system prompt and the first user message stay) and the turn
goes on; with --session-overflow error the turn is a 400 and the session is unchanged."""

from __future__ import annotations

import pytest

from superfluid.core.sessions import Session, SessionStore

SYSTEM = "You are a build agent. Answer in one short sentence."
CONTEXT = 512
FILLER = "Step report: the compiler finished, the linker finished, the tests ran and passed again. "


def _conversation(n_turns: int) -> list[dict]:
    messages = [{"role": "user", "content": "Run the build."}]
    for i in range(n_turns):
        messages.append({"role": "assistant", "content": "", "tool_calls": [{"id": f"c{i}"}]})
        messages.append({"role": "tool", "tool_call_id": f"c{i}", "content": f"ok {i}"})
    return messages


def test_window_keeps_the_anchor_and_cuts_before_assistant_or_user_messages():
    s = Session(id="s", model="m", qos="agent", system="sys", messages=_conversation(3))
    assert s.anchor == 1
    assert s.window_cuts() == [3, 5]  # assistant messages after the first exchange; never a tool result
    assert [m["role"] for m in s.history(3)] == ["system", "user", "assistant", "tool", "assistant", "tool"]
    s.window_start = 5
    assert s.dropped_messages == 4 and s.window_cuts() == []
    assert s.history()[:2] == [{"role": "system", "content": "sys"}, s.messages[0]]
    assert s.history()[2:] == s.messages[5:]


def test_window_survives_a_restart_and_a_bad_window_record_is_skipped(tmp_path):
    store = SessionStore(str(tmp_path))
    s = store.create("m", "agent", "sys")
    for i, m in enumerate(_conversation(3)[1:]):
        if m["role"] == "assistant":
            store.record_turn(s, [_conversation(3)[0]] if i == 0 else [], m, [1, 2, 3])
    store.drop_before(s, 2)
    again = SessionStore(str(tmp_path))
    again.recover()
    assert again.get(s.id).window_start == 2 and again.get(s.id).messages == s.messages
    with open(tmp_path / "sessions" / f"{s.id}.jsonl", "a") as f:
        f.write('{"op": "window", "start": 999}\n')
    third = SessionStore(str(tmp_path))
    third.recover()
    assert third.get(s.id).window_start == 2  # the record outside the conversation was skipped


def _turn(srv, sid: str, i: int):
    return srv.call("POST", f"/v1/sessions/{sid}/turns",
                    {"messages": [{"role": "user", "content": f"{FILLER}Report {i}?"}],
                     "max_tokens": 16, "temperature": 0})


@pytest.fixture(scope="module")
def small_context_server(start_server, tmp_path_factory):
    state = tmp_path_factory.mktemp("window-state")
    return start_server("--max-batch", "2", "--max-context", str(CONTEXT), "--state-dir", str(state))


def test_truncate_keeps_a_long_session_going(small_context_server):
    srv = small_context_server
    status, session = srv.call("POST", "/v1/sessions", {"system": SYSTEM})
    assert status == 201
    sid = session["id"]
    usages, cut_at = [], None
    for i in range(1, 25):  # ~45 tokens a turn: the 512-token context overflows within ~11 turns
        status, body = _turn(srv, sid, i)
        assert status == 200, body
        usages.append(body["usage"])
        view = srv.call("GET", f"/v1/sessions/{sid}")[1]
        if view["dropped_messages"] and cut_at is None:
            cut_at = i
        if cut_at is not None and i >= cut_at + 2:
            break
    assert cut_at is not None, "the history never outgrew the context"
    assert view["turns"] == i and len(view["messages"]) == 2 * i  # the log keeps every message
    assert view["messages"][0]["content"].startswith(FILLER)
    # The cut turn's prompt fits in half the context plus its new message; its system prompt and
    # first message came from the cache; the turn after it reuses the cut history.
    cut_usage = usages[cut_at - 1]
    assert cut_usage["prompt_tokens"] <= CONTEXT // 2 + 60, cut_usage
    assert cut_usage["prompt_tokens_details"]["cached_tokens"] > 0, cut_usage
    after = usages[cut_at]
    assert after["prompt_tokens_details"]["cached_tokens"] >= after["prompt_tokens"] - 80, after


def test_overflow_error_answers_400_and_changes_nothing(start_server):
    srv = start_server("--max-batch", "2", "--max-context", str(CONTEXT), "--session-overflow", "error")
    try:
        sid = srv.call("POST", "/v1/sessions", {"system": SYSTEM})[1]["id"]
        for i in range(1, 25):
            status, body = _turn(srv, sid, i)
            if status != 200:
                break
        assert status == 400, body
        assert body["error"]["code"] == "context_length_exceeded", body
        view = srv.call("GET", f"/v1/sessions/{sid}")[1]
        assert view["turns"] == i - 1 and view["dropped_messages"] == 0 and not view["busy"]
    finally:
        srv.stop()


def test_session_overflow_value_is_checked():
    from superfluid.core.cli import load
    from superfluid.core.errors import ConfigError
    with pytest.raises(ConfigError, match="session-overflow"):
        load(["serve", "--session-overflow", "drop"])
