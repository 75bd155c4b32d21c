"""Carries a request's lane events from the model's thread into the event loop."""

from __future__ import annotations

import asyncio
import collections
import functools

from superfluid.core.lane import LaneEvent

_ENDS = ("finished", "error")


class EventBridge:
    """The sink of a request's lanes (one, or ``lanes`` for a reply of ``n`` choices): hands
    their events to one asyncio queue without blocking the scheduler.

    The bridge itself is lane 0's sink; :meth:`lane` gives lane ``i``'s. One queue for all of
    them, so a reply of n choices is answered in the order its lanes' events come, interleaved,
    by one consumer (:meth:`tagged`).

    ``hold_deltas`` (for replies sent whole): text deltas wait on the scheduler's side and reach
    the loop together with their lane's final event. Waking the loop costs a syscall and a thread
    switch per lane per tick, taken from the engine's cores on a small machine, for text nobody
    reads before the end. ``catchup`` (the front end's :class:`~.catchup.LoopCatchup`) counts
    each wake-up, so the scheduler waits for the loop only after a tick that handed it something."""

    def __init__(self, loop: asyncio.AbstractEventLoop, *, hold_deltas: bool = False, catchup=None,
                 lanes: int = 1):
        self._loop = loop
        self._catchup = catchup
        self.queue: asyncio.Queue[tuple[int, LaneEvent]] = asyncio.Queue()
        self.hold_deltas = hold_deltas
        self.lanes = lanes
        self._held = [collections.deque() for _ in range(lanes)]
        self._ended = [False] * lanes

    @property
    def done(self) -> bool:
        """Every lane has finished or failed (and the consumer has seen it)."""
        return all(self._ended)

    def ended(self, index: int) -> bool:
        return self._ended[index]

    def lane(self, index: int):
        """Lane ``index``'s sink (lane 0's is the bridge itself)."""
        return self if index == 0 else functools.partial(self._post, index)

    def __call__(self, event: LaneEvent) -> None:
        self._post(0, event)

    def _post(self, index: int, event: LaneEvent) -> None:
        if self.hold_deltas and event.kind == "delta":
            self._held[index].append(event)
            return
        if self._catchup is not None:
            self._catchup.note_post()
        self._loop.call_soon_threadsafe(self.queue.put_nowait, (index, event))

    async def tagged(self):
        """Yield (lane index, event) until every lane has finished or failed (those events
        included); a lane's held deltas come out in order before the event that released them."""
        while not self.done:
            index, event = await self.queue.get()
            held = self._held[index]
            while held:  # appended before ``event`` was posted, so all of them are here
                yield index, held.popleft()
            if event.kind in _ENDS:
                self._ended[index] = True
            yield index, event

    async def events(self):
        """A one-lane request's events, until it finishes or fails (that event included)."""
        async for _, event in self.tagged():
            yield event
