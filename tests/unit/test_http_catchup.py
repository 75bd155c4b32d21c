"""plugins/http/catchup.py: the catch-up is one front end's object, reached by the models'
threads through the tick hook it registers, not through module state."""

from __future__ import annotations

import asyncio
import threading
import time

import pluggy

from superfluid.core import hookspecs
from superfluid.core.lane import LaneEvent
from superfluid.plugins.http import catchup as catchup_module
from superfluid.plugins.http.bridge import EventBridge
from superfluid.plugins.http.catchup import LoopCatchup


def test_two_front_ends_count_their_own_wake_ups():
    async def main():
        loop = asyncio.get_running_loop()
        a, b = LoopCatchup(loop, enabled=True), LoopCatchup(loop, enabled=True)
        EventBridge(loop, catchup=a)(LaneEvent("delta", "l", text="x"))
        EventBridge(loop, hold_deltas=True, catchup=b)(LaneEvent("delta", "l", text="x"))
        return a.posted, b.posted

    assert asyncio.run(main()) == (1, 0)


def test_the_tick_hook_reaches_a_registered_catchup_and_stops_at_detach():
    async def main():
        loop = asyncio.get_running_loop()
        catchup = LoopCatchup(loop, enabled=True)
        pm = pluggy.PluginManager("superfluid")
        pm.add_hookspecs(hookspecs)
        pm.register(catchup, name="catchup")
        waits = []
        real = catchup.wait_for_loop

        def counted():
            waits.append(threading.current_thread().name)
            real()

        catchup.wait_for_loop = counted
        EventBridge(loop, catchup=catchup)(LaneEvent("delta", "l", text="x"))
        await loop.run_in_executor(None, lambda: pm.hook.superfluid_tick_done(model="m", stats=None))
        catchup.detach()
        pm.unregister(catchup)
        await loop.run_in_executor(None, lambda: pm.hook.superfluid_tick_done(model="m", stats=None))
        return waits, catchup.loop

    waits, loop = asyncio.run(main())
    assert len(waits) == 1 and loop is None


def test_a_detached_or_disabled_catchup_returns_at_once(monkeypatch):
    """Called from the loop's own thread (so the loop cannot run), an enabled catch-up waits its
    whole MAX_WAIT_S; a disabled one, a detached one and one with no loop return at once."""
    monkeypatch.setattr(catchup_module, "MAX_WAIT_S", 0.5)  # long enough to tell a wait from none

    def seconds_waited(catchup: LoopCatchup) -> float:
        catchup.note_post()  # an event reached the loop since the last call: something to wait for
        start = time.perf_counter()
        catchup.wait_for_loop()
        return time.perf_counter() - start

    async def main():
        loop = asyncio.get_running_loop()
        detached = LoopCatchup(loop, enabled=True)
        detached.detach()
        return (seconds_waited(LoopCatchup(loop, enabled=True)),
                [seconds_waited(c) for c in (LoopCatchup(loop, enabled=False), detached,
                                             LoopCatchup(None, enabled=True))])

    enabled, at_once = asyncio.run(main())
    assert enabled >= 0.5  # the control: a catch-up that waits is seen waiting here
    assert max(at_once) < 0.25, at_once
