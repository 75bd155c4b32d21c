"""Carries a request's lane events from the scheduler thread into the event loop."""

from __future__ import annotations

import asyncio

from superfluid.core.lane import LaneEvent


class EventBridge:
    """A request sink that hands events to an asyncio queue without blocking the scheduler."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = loop
        self.queue: asyncio.Queue[LaneEvent] = asyncio.Queue()
        self.done = False

    def __call__(self, event: LaneEvent) -> None:
        self._loop.call_soon_threadsafe(self.queue.put_nowait, event)

    async def events(self):
        """Yield events until the lane finishes or fails (that event included)."""
        while True:
            event = await self.queue.get()
            if event.kind in ("finished", "error"):
                self.done = True
            yield event
            if self.done:
                return
