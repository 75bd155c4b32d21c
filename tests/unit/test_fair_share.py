"""The fair-share example plugin (examples/fair-share, installed through its entry point) on a
fake engine: deficit round robin between tenants within a class, the default policy's class order
kept, a lone tenant given every lane, and nothing changed until its option is on."""

from __future__ import annotations

import pytest

from .fakes import drive, prompt, submit

ON = {"fair-share": True}


@pytest.fixture(autouse=True)
def installed(plugin_manager):
    assert plugin_manager.has_plugin("fair_share"), "examples/fair-share is not installed (tools/dev/setup.sh)"


def admissions(make, requests, *, max_batch, max_tokens=3, extra=None, classes=False):
    """Queue ``requests`` ((tenant, qos) pairs, tenant None for none) before the first tick, run
    them all on a fake engine; the tenants in the order their lanes were first admitted (with
    ``classes``: (tenant, class) pairs)."""
    loop, engine = make(start=False, max_batch=max_batch, extra=dict(extra or {}))
    log: list = []
    owners, sinks = {}, []
    for i, (who, cls) in enumerate(requests):
        meta = {"tenant": who} if who else {}
        req, sink = submit(loop, prompt(10 * i, 6), max_tokens, qos=cls, log=log, meta=meta)
        owners[req.id] = (who, cls) if classes else who
        sinks.append(sink)
    drive(loop, engine, lambda: all(s.done.is_set() for s in sinks), max_ticks=2000)
    assert not engine.errors
    assert all(s.events[-1].kind == "finished" for s in sinks)
    return [owners[rid] for kind, rid in log if kind == "admitted"]


def flood_then_three(n_flood=8, each=2):
    """One tenant queues ``n_flood`` requests, then three others ``each`` apiece (one class)."""
    reqs = [("key:flood", "agent")] * n_flood
    for name in ("key:a", "key:b", "key:c"):
        reqs += [(name, "agent")] * each
    return reqs


@pytest.mark.parametrize("max_batch", [1, 2, 4])
def test_lanes_go_round_robin_between_tenants(make, max_batch):
    order = admissions(make, flood_then_three(), max_batch=max_batch, extra=ON)
    rounds = ["key:flood", "key:a", "key:b", "key:c"] * 2
    assert order == rounds + ["key:flood"] * 6, order


def test_without_the_option_the_order_is_fifo(make):
    order = admissions(make, flood_then_three(), max_batch=2)
    assert order == ["key:flood"] * 8 + ["key:a"] * 2 + ["key:b"] * 2 + ["key:c"] * 2


def test_an_interactive_request_still_goes_first(make):
    """The default policy's class order stands: the flooding tenant's own interactive request is
    admitted before the other tenants' agent work, and agent lanes then share round robin."""
    reqs = [("key:flood", "agent")] * 4 + [("key:a", "agent"), ("key:b", "agent"), ("key:flood", "interactive")]
    order = admissions(make, reqs, max_batch=1, extra=ON, classes=True)
    assert order[0] == ("key:flood", "interactive"), order
    assert order[1:4] == [("key:flood", "agent"), ("key:a", "agent"), ("key:b", "agent")], order


def test_interactive_first_with_lanes_taken(make):
    """With every lane busy an interactive request preempts (the qos plugin's rule), whatever
    fair-share would say of its tenant."""
    loop, engine = make(start=False, max_batch=2, extra=dict(ON))
    log: list = []
    sinks = [submit(loop, prompt(10 * i, 6), 40, qos="agent", log=log, meta={"tenant": "key:flood"})[1]
             for i in range(4)]
    drive(loop, engine, lambda: sum(k == "admitted" for k, _ in log) == 2)
    req, chat = submit(loop, prompt(500, 6), 3, qos="interactive", log=log, meta={"tenant": "key:flood"})
    drive(loop, engine, chat.done.is_set)
    assert any(k == "paused" for k, _ in log), "no agent lane was preempted for the chat"
    assert not all(s.done.is_set() for s in sinks), "the chat waited for the agents"
    drive(loop, engine, lambda: all(s.done.is_set() for s in sinks), max_ticks=2000)


def test_a_lone_tenant_gets_every_lane(make):
    loop, engine = make(start=False, max_batch=4, extra=dict(ON))
    sinks = [submit(loop, prompt(10 * i, 6), 20, meta={"tenant": "key:only"})[1] for i in range(6)]
    loop.step()
    assert len(loop.snapshot()["slots"]) == 4
    assert sum(s["state"] != "free" for s in loop.snapshot()["slots"]) == 4
    drive(loop, engine, lambda: all(s.done.is_set() for s in sinks), max_ticks=2000)


def test_requests_without_a_tenant_share_one_bucket(make):
    reqs = [(None, "agent")] * 4 + [("user:ann", "agent")] * 2
    order = admissions(make, reqs, max_batch=1, extra=ON)
    assert order == [None, "user:ann", None, "user:ann", None, None], order
