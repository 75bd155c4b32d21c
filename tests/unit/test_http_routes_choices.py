"""plugins/http/openai/routes.py with n choices, against a fake scheduler: every choice's lane is
submitted, answered and, when the client goes away or one is refused, cancelled; a key's lane
slots are counted per choice."""

from __future__ import annotations

import asyncio
import json

import attrs
import pytest

from superfluid.core.errors import QueueFull
from superfluid.core.lane import LaneEvent
from superfluid.plugins.http.keys.limits import KeyLimits, TooManyConcurrent
from superfluid.plugins.http.manage.protocol import SessionTurnRequest
from superfluid.plugins.http.openai.protocol import CompletionRequest
from superfluid.plugins.http.openai.routes import OpenAIRoutes, _admit
from superfluid.plugins.http.typed import parse

from .test_http_prepare import CONFIG, FakeDaemon


class Http:
    headers: dict = {}
    remote, method, path = "127.0.0.1", "POST", "/v1/completions"


class Scheduler:
    """Answers each request at once (``answer``), or never; refuses the ``refuse``-th submit."""

    def __init__(self, answer=True, refuse=None):
        self.answer, self.refuse = answer, refuse
        self.submitted, self.cancelled = [], []

    def submit(self, req):
        if len(self.submitted) == self.refuse:
            raise QueueFull("full")
        self.submitted.append(req)
        if self.answer:
            i = len(self.submitted)
            req.sink(LaneEvent("delta", req.id, text=f"c{i}", token_ids=(i,)))
            req.sink(LaneEvent("finished", req.id, finish_reason="stop", prompt_tokens=2, completion_tokens=1))

    def cancel(self, request_id):
        self.cancelled.append(request_id)


def routes(scheduler) -> OpenAIRoutes:
    daemon = FakeDaemon(True, 64)
    runtime = daemon.runtime
    runtime.loop.submit, runtime.loop.cancel = scheduler.submit, scheduler.cancel
    runtime.engine.token_bytes = lambda t: b""
    runtime.engine.capabilities.generates = True
    return OpenAIRoutes(daemon, CONFIG)


BODY = {"prompt": "a b", "n": 3, "max_tokens": 2}


def test_three_choices_are_three_lanes_answered_in_one_reply():
    sched = Scheduler()

    async def main():
        return await routes(sched)._generate(Http(), parse(CompletionRequest, BODY), 1.0)

    resp = asyncio.run(main())
    got = json.loads(resp.body)
    assert [(c["index"], c["text"]) for c in got["choices"]] == [(0, "c1"), (1, "c2"), (2, "c3")]
    assert got["usage"] == {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5,
                            "prompt_tokens_details": {"cached_tokens": 0}}
    assert len({r.id for r in sched.submitted}) == 3 and sched.cancelled == []


def test_a_client_that_leaves_cancels_every_choice():
    sched = Scheduler(answer=False)

    async def main():
        task = asyncio.create_task(routes(sched)._generate(Http(), parse(CompletionRequest, BODY), 1.0))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert sorted(sched.cancelled) == sorted(r.id for r in sched.submitted) and len(sched.cancelled) == 3


def test_a_refused_choice_cancels_those_already_queued():
    sched = Scheduler(answer=False, refuse=2)

    async def main():
        await routes(sched)._generate(Http(), parse(CompletionRequest, BODY), 1.0)

    with pytest.raises(QueueFull):
        asyncio.run(main())
    assert sched.cancelled == [r.id for r in sched.submitted] and len(sched.submitted) == 2


def test_a_sessions_turn_has_one_choice():
    async def main():
        turn = parse(SessionTurnRequest, {"messages": [{"role": "user", "content": "x"}], "n": 2})
        await routes(Scheduler()).generate_chat(Http(), turn, "m", qos="agent", on_finish=lambda *a: None)

    with pytest.raises(Exception) as info:
        asyncio.run(main())
    assert getattr(info.value, "param", None) == "n"


@attrs.define(frozen=True)
class Key:
    name: str = "k"
    requests_per_minute: int = 0
    tokens_per_minute: int = 100
    lanes: int = 2


def test_each_choice_takes_a_lane_slot_and_the_prompt_is_charged_once():
    limits = KeyLimits()
    tickets = _admit(limits, Key(), 10, 2)
    assert limits.in_flight(Key()) == 2 and [t.prompt for t in tickets] == [10, 0]
    with pytest.raises(TooManyConcurrent):
        _admit(limits, Key(), 10, 1)
    for t in tickets:
        t.end(1)
    assert limits.in_flight(Key()) == 0
    with pytest.raises(TooManyConcurrent):  # all or none: the two admitted are given back
        _admit(limits, Key(), 10, 3)
    assert limits.in_flight(Key()) == 0
