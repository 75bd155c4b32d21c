"""Stored responses' retention (:class:`~superfluid.plugins.http.responses.chains.Chains` with a
test clock, on a real SessionStore in a state dir): the TTL and the cap evict the oldest first, a
conversation keeps its turns while it holds another stored response and is removed (log and
all) once it holds none, a restart keeps the order, and a session opened by POST /v1/sessions is
never removed. The server-level behaviour is tests/server/test_responses_retention.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from superfluid.core.sessions import SessionStore
from superfluid.plugins.http.keys.auth import KEY
from superfluid.plugins.http.responses.chains import Chains, ResponseNotFound

ALICE = {KEY: SimpleNamespace(name="alice", admin=False)}
TURN = dict(model="smollm2", qos="agent", reply={"role": "assistant", "content": "hi"}, prompt_tokens=[1, 2])


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def _store(chains, rid, session=None):
    return chains.record(ALICE, session, new=[{"role": "user", "content": rid}], response={"id": rid}, **TURN)


def _kept(chains, *rids):
    out = set()
    for rid in rids:
        try:
            chains.find(ALICE, rid)
            out.add(rid)
        except ResponseNotFound:
            pass
    return out


def test_the_cap_evicts_the_oldest_and_a_conversation_goes_with_its_last(tmp_path):
    store, clock = SessionStore(str(tmp_path)), Clock()
    chains = Chains(store, cap=2, clock=clock)
    own = store.create("smollm2", "agent", None)  # POST /v1/sessions'
    a = _store(chains, "r1")
    clock.now += 1
    _store(chains, "r2", a)
    clock.now += 1
    b = _store(chains, "r3")  # over the cap: r1 goes, conversation a keeps going from r2
    assert _kept(chains, "r1", "r2", "r3") == {"r2", "r3"} and a.id in store.sessions and a.turns == 2
    clock.now += 1
    _store(chains, "r4")  # r2 goes: a holds no stored response, so it is removed with its log
    assert _kept(chains, "r2", "r3", "r4") == {"r3", "r4"}
    assert a.id not in store.sessions and not (tmp_path / "sessions" / f"{a.id}.jsonl").exists()
    assert b.id in store.sessions and own.id in store.sessions
    # a restart keeps the order: the next one evicts r3, the oldest
    again = SessionStore(str(tmp_path))
    again.recover()
    restored = Chains(again, cap=2, clock=clock)
    clock.now += 1
    _store(restored, "r5")
    assert _kept(restored, "r3", "r4", "r5") == {"r4", "r5"} and b.id not in again.sessions
    assert own.id in again.sessions


def test_the_ttl_counts_from_storing(tmp_path):
    store, clock = SessionStore(str(tmp_path)), Clock()
    chains = Chains(store, ttl=10, clock=clock)
    s = _store(chains, "r1")
    clock.now += 6
    _store(chains, "r2")
    clock.now += 5  # r1 is 11 s old, r2 5 s
    assert chains.sweep() == 1 and _kept(chains, "r1", "r2") == {"r2"} and s.id not in store.sessions
    clock.now += 6
    with pytest.raises(ResponseNotFound):  # found expired on use, with no sweep between
        chains.find(ALICE, "r2")
    assert not store.sessions


def test_nothing_is_evicted_without_limits(tmp_path):
    store, clock = SessionStore(str(tmp_path)), Clock()
    chains = Chains(store, clock=clock)
    for i in range(5):
        _store(chains, f"r{i}")
        clock.now += 10 ** 6
    assert chains.sweep() == 0 and len(store.sessions) == 5
