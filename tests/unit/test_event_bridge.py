"""The bridge between a model's thread and the HTTP event loop: replies sent whole hold their
deltas until the final event, streams get each as it comes, and the catch-up wait is skipped
when a tick handed the loop nothing."""

import asyncio
import threading

from superfluid.core.lane import LaneEvent
from superfluid.plugins.http.bridge import EventBridge
from superfluid.plugins.http.catchup import LoopCatchup


def _collect_from_thread(hold: bool):
    """Post from another thread, as the scheduler does: the loop's queue size after the deltas,
    every event the consumer saw (in order), and whether the bridge is done."""

    async def main():
        loop = asyncio.get_running_loop()
        bridge = EventBridge(loop, hold_deltas=hold)

        def scheduler():
            for text in ("a", "b", "c"):
                bridge(LaneEvent("delta", "lane-1", text=text))

        t = threading.Thread(target=scheduler)
        t.start()
        t.join()
        await asyncio.sleep(0.01)
        queued = bridge.queue.qsize()
        threading.Thread(target=lambda: bridge(LaneEvent("finished", "lane-1", finish_reason="stop"))).start()
        seen = [(e.kind, e.text) async for e in bridge.events()]
        return queued, seen, bridge.done

    return asyncio.run(main())


def test_held_deltas_reach_the_loop_with_the_final_event_in_order():
    queued, seen, done = _collect_from_thread(hold=True)
    assert queued == 0  # nothing woke the loop for the deltas
    assert seen == [("delta", "a"), ("delta", "b"), ("delta", "c"), ("finished", "")]
    assert done


def test_streamed_deltas_reach_the_loop_as_they_come():
    queued, seen, done = _collect_from_thread(hold=False)
    assert queued == 3
    assert seen == [("delta", "a"), ("delta", "b"), ("delta", "c"), ("finished", "")]


def test_an_error_releases_held_deltas_first():
    async def main():
        bridge = EventBridge(asyncio.get_running_loop(), hold_deltas=True)
        bridge(LaneEvent("delta", "lane-1", text="partial"))
        bridge(LaneEvent("error", "lane-1"))
        return [e.kind async for e in bridge.events()]

    assert asyncio.run(main()) == ["delta", "error"]


def test_catchup_waits_only_when_the_loop_was_handed_something():
    async def main():
        loop = asyncio.get_running_loop()
        catchup = LoopCatchup(loop, enabled=True)
        hops = []
        real = loop.call_soon_threadsafe

        def counting(callback, *args, **kwargs):
            hops.append(callback)
            return real(callback, *args, **kwargs)

        loop.call_soon_threadsafe = counting
        try:
            def tick(hold):
                bridge = EventBridge(loop, hold_deltas=hold, catchup=catchup)
                bridge(LaneEvent("delta", "lane-1", text="x"))
                before = len(hops)
                catchup.wait_for_loop()
                return len(hops) - before

            waits = []
            for hold in (False, True, True, False):
                waits.append(await loop.run_in_executor(None, tick, hold))
            return waits
        finally:
            del loop.call_soon_threadsafe
            catchup.detach()

    # A streamed tick posted events, so catch-up hands the loop its two-hop probe (one
    # call_soon_threadsafe); a tick of held deltas posted nothing and returns at once.
    assert asyncio.run(main()) == [1, 0, 0, 1]
