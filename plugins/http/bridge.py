"""Carries a request's lane events from the scheduler thread into the event loop."""

from __future__ import annotations

import asyncio
import collections

from superfluid.core.lane import LaneEvent


class EventBridge:
    """A request sink that hands events to an asyncio queue without blocking the scheduler.

    ``hold_deltas`` (for replies sent whole): text deltas wait on the scheduler's side and reach
    the loop together with the final event. Waking the loop costs a syscall and a thread switch
    per lane per tick, taken from the engine's cores on a small machine, for text nobody reads
    before the end. ``catchup`` (the front end's :class:`~.catchup.LoopCatchup`) counts each
    wake-up, so the scheduler waits for the loop only after a tick that handed it something."""

    def __init__(self, loop: asyncio.AbstractEventLoop, *, hold_deltas: bool = False, catchup=None):
        self._loop = loop
        self._catchup = catchup
        self.queue: asyncio.Queue[LaneEvent] = asyncio.Queue()
        self.done = False
        self.hold_deltas = hold_deltas
        self._held: collections.deque[LaneEvent] = collections.deque()

    def __call__(self, event: LaneEvent) -> None:
        if self.hold_deltas and event.kind == "delta":
            self._held.append(event)
            return
        if self._catchup is not None:
            self._catchup.note_post()
        self._loop.call_soon_threadsafe(self.queue.put_nowait, event)

    async def events(self):
        """Yield events until the lane finishes or fails (that event included); held deltas come
        out in order before the event that released them."""
        while True:
            event = await self.queue.get()
            while self._held:  # appended before ``event`` was posted, so all of them are here
                yield self._held.popleft()
            if event.kind in ("finished", "error"):
                self.done = True
            yield event
            if self.done:
                return
