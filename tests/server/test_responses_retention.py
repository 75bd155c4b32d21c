"""Stored responses' retention and input items, on the real server through the ``openai`` SDK:
``--responses-ttl`` (a tiny one: the conversation's log goes with no traffic, then GET is OpenAI's
404), ``--responses-max`` (the oldest evicted first; a conversation keeps its turns while it holds
another stored response, and is removed from --state-dir once it holds none; a session opened by
POST /v1/sessions is never touched), and ``GET /v1/responses/{id}/input_items`` paged by the SDK
(limit, order, after/before, auto-pagination, a bad limit's 400)."""

from __future__ import annotations

import time

import pytest

openai = pytest.importorskip("openai")

# seconds from storing: long enough to see the conversation's log before it goes (the test looks
# at once, milliseconds after the response was stored), short because the test waits it out; the
# server sweeps every max(TTL / 10, 0.5) s with no traffic
TTL = 2


def _client(srv):
    return openai.OpenAI(base_url=srv.base + "/v1", api_key="none", timeout=120, max_retries=0)


def _ask(client, text: str, previous: str | None = None):
    return client.responses.create(model="smollm2", input=text, max_output_tokens=4, temperature=0,
                                   previous_response_id=previous)


def _logs(state):
    return {p.stem for p in (state / "sessions").glob("*.jsonl")}


def _poll(cond, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.1)
    return False


def _gone(client, rid: str) -> bool:
    try:
        client.responses.retrieve(rid)
    except openai.NotFoundError:
        return True
    return False


@pytest.fixture(scope="module")
def ttl_srv(start_server, tmp_path_factory):
    state = tmp_path_factory.mktemp("responses-ttl-state")
    srv = start_server("--state-dir", str(state), "--responses-ttl", f"{TTL}s", "--max-batch", "2")
    srv.state = state
    return srv


@pytest.fixture(scope="module")
def cap_srv(start_server, tmp_path_factory):
    state = tmp_path_factory.mktemp("responses-cap-state")
    srv = start_server("--state-dir", str(state), "--responses-max", "3", "--max-batch", "2")
    srv.state = state
    return srv


# ---- input items ---------------------------------------------------------------------------------

def test_input_items_are_listed_and_paged_as_openai_pages_them(cap_srv):
    client = _client(cap_srv)
    words = ["apple", "birch", "cedar", "dune", "ember"]
    texts = [f"Note number {i}: remember the word {w}." for i, w in enumerate(words)]
    resp = client.responses.create(model="smollm2", max_output_tokens=4, temperature=0, instructions="Be brief.",
                                   input=[{"role": "user", "content": t} for t in texts])
    everything = list(client.responses.input_items.list(resp.id, limit=2, order="asc"))  # auto-paginates
    assert [item.content[0].text for item in everything] == texts  # instructions are no item
    assert all(item.type == "message" and item.role == "user" and item.id for item in everything)
    assert len({item.id for item in everything}) == 5

    first = client.responses.input_items.list(resp.id, limit=2, order="asc")
    assert [i.id for i in first.data] == [everything[0].id, everything[1].id] and first.has_more
    assert first.first_id == everything[0].id and first.last_id == everything[1].id
    latest = client.responses.input_items.list(resp.id)  # default: desc, 20
    assert [i.id for i in latest.data] == [i.id for i in reversed(everything)] and not latest.has_more
    after = client.responses.input_items.list(resp.id, order="asc", after=everything[1].id, limit=10)
    assert [i.id for i in after.data] == [i.id for i in everything[2:]] and not after.has_more
    before = client.responses.input_items.list(resp.id, order="asc", limit=2,  # before: the reference's, not the SDK's
                                              extra_query={"before": everything[3].id})
    assert [i.id for i in before.data] == [everything[1].id, everything[2].id] and before.has_more

    with pytest.raises(openai.BadRequestError) as bad:
        client.responses.input_items.list(resp.id, limit=101)
    assert bad.value.body["param"] == "limit"
    with pytest.raises(openai.NotFoundError):
        client.responses.input_items.list("resp_nope")


def test_a_string_input_is_one_user_message_item(cap_srv):
    client = _client(cap_srv)
    resp = _ask(client, "Say yes.")
    page = client.responses.input_items.list(resp.id)
    assert len(page.data) == 1 and page.data[0].role == "user" and page.data[0].content[0].text == "Say yes."


# ---- the cap -------------------------------------------------------------------------------------

def test_the_oldest_are_evicted_first_and_a_conversation_goes_with_its_last(cap_srv):
    client = _client(cap_srv)
    state = cap_srv.state
    status, opened = cap_srv.call("POST", "/v1/sessions", {"model": "smollm2"})
    assert status == 201, opened
    before = _logs(state)
    r1 = _ask(client, "Count: one.")
    conv_a = _logs(state) - before
    r2 = _ask(client, "Two.", previous=r1.id)  # the same conversation
    before = _logs(state)
    r3 = _ask(client, "Letters: a.")
    conv_b = _logs(state) - before
    assert len(conv_a) == len(conv_b) == 1
    r4 = _ask(client, "Colours: red.")
    # four stored with a cap of 3: r1, the oldest, is gone; its conversation keeps going from r2
    assert _gone(client, r1.id) and not _gone(client, r2.id) and not _gone(client, r3.id)
    assert conv_a <= _logs(state)
    r5 = _ask(client, "Three.", previous=r2.id)
    assert _gone(client, r2.id) and client.responses.retrieve(r5.id).id == r5.id
    r6 = _ask(client, "Shapes: square.")
    # r3 was its conversation's only stored response: the session and its log are removed
    assert _gone(client, r3.id) and not (_logs(state) & conv_b)
    assert {r.id for r in (r4, r5, r6) if not _gone(client, r.id)} == {r4.id, r5.id, r6.id}
    # POST /v1/sessions' own session is never evicted
    assert opened["id"] in _logs(state)
    assert cap_srv.call("GET", f"/v1/sessions/{opened['id']}")[0] == 200
    log = cap_srv.log_path.read_text(errors="replace")
    assert f"stored response {r1.id} evicted (over --responses-max 3" in log
    assert f"stored response {r3.id} evicted" in log and "is removed" in log


# ---- the TTL -------------------------------------------------------------------------------------

def test_an_expired_response_is_removed_with_no_traffic_and_is_a_404(ttl_srv):
    client = _client(ttl_srv)
    state = ttl_srv.state
    status, opened = ttl_srv.call("POST", "/v1/sessions", {"model": "smollm2"})
    assert status == 201, opened
    resp = _ask(client, "Say hi.")
    conv = _logs(state) - {opened["id"]}
    assert len(conv) == 1
    # the timer's sweep removes the conversation's log without any request naming it
    assert _poll(lambda: not (_logs(state) & conv), timeout=TTL + 30), "the expired conversation's log stayed"
    with pytest.raises(openai.NotFoundError) as err:
        client.responses.retrieve(resp.id)
    assert err.value.body["code"] == "response_not_found" and err.value.body["param"] == "response_id"
    with pytest.raises(openai.NotFoundError):
        _ask(client, "Again.", previous=resp.id)
    assert opened["id"] in _logs(state)  # POST /v1/sessions' session stays
    assert f"stored response {resp.id} evicted (older than --responses-ttl {TTL}s)" in \
        ttl_srv.log_path.read_text(errors="replace")
