"""The right to preempt belongs to a lane's own class: queue aging orders admission but does not
take that right away. The real Scheduler and the real qos plugin, planning only (no engine)."""

from __future__ import annotations

import time

import pytest

from superfluid.core.engine import EngineCapabilities
from superfluid.core.lane import Lane, LaneState
from superfluid.core.plugins import make_plugin_manager
from superfluid.core.request import Request
from superfluid.core.scheduler import Scheduler
from superfluid.core.settings import SchedulerSettings
from superfluid.core.textstream import TextStream


@pytest.fixture(scope="module")
def hook():
    return make_plugin_manager().hook


def lane(qos: str, first: int) -> Lane:
    req = Request(prompt_tokens=list(range(first, first + 20)), max_tokens=400, sink=lambda e: None, qos=qos)
    return Lane(request=req, text=TextStream(lambda t: b"x"))


@pytest.mark.parametrize("starvation_ticks", [1, 8])
def test_aged_agents_do_not_outrank_an_interactive_request_for_preemption(hook, starvation_ticks):
    caps = EngineCapabilities(max_lanes=2, context_length=4096)
    sched = Scheduler("rights", caps, hook, SchedulerSettings(max_batch=2, starvation_ticks=starvation_ticks))
    agents = [lane("agent", 100 * i) for i in range(4)]
    for a in agents:
        sched.add(a)
    sched.schedule(time.monotonic())
    assert [l.state for l in agents] == [LaneState.PREFILLING] * 2 + [LaneState.QUEUED] * 2
    for _ in range(3 * starvation_ticks):  # the queued agents age to the interactive class
        sched.schedule(time.monotonic())
    assert min(l.waited_ticks for l in sched.queue) >= 2 * starvation_ticks
    chat = lane("interactive", 900)
    sched.add(chat)
    sched.schedule(time.monotonic())
    assert chat in sched.lanes, "the chat waits behind aged agents although every lane runs an agent"
    assert sum(a.state == LaneState.PREEMPTED for a in agents) == 1
    assert all(a.state != LaneState.PREEMPTED or a in sched.queue for a in agents)

