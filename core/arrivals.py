"""The arrival window: waking from idle, how long a model waits for a burst to arrive.

Requests sent together reach the loop a few ms apart; waiting a moment lets their prefills share
the first tick instead of queueing behind one another's. A lone request pays for that wait (a
quiet gap of ARRIVAL_QUIET_S at least), and so does every request of a client that sends one at
a time (an editor's completions, a sequential agent). So the window learns whether waiting
pays: after LONE_WAKES wake-ups in a row that gathered nobody it stops waiting, and it waits
again as soon as a request arrives within ARRIVAL_WINDOW_S of a wake-up it did not wait on
(that request, a burst's second, joins the next tick instead of the first)."""

from __future__ import annotations

import threading
import time
from typing import Callable

ARRIVAL_WINDOW_S = 0.010  # longest wait for a burst
ARRIVAL_QUIET_S = 0.003   # a gap this long without a new request ends the wait
LONE_WAKES = 3            # wake-ups in a row that gathered nobody before waiting stops


class ArrivalWindow:
    def __init__(self) -> None:
        self.count = 0       # requests arrived so far
        self._lone = 0       # wake-ups in a row that gathered nobody
        self._skipped_at: float | None = None  # the last wake-up that did not wait

    @property
    def waiting(self) -> bool:
        """Whether the next wake-up waits for a burst."""
        return self._lone < LONE_WAKES

    def arrived(self, now: float) -> None:
        """A request was queued (called with the model's lock held)."""
        self.count += 1
        if self._skipped_at is not None and now - self._skipped_at <= ARRIVAL_WINDOW_S:
            self._lone, self._skipped_at = 0, None  # a burst came after all: wait again

    def gather(self, cv: threading.Condition, done: Callable[[], bool]) -> None:
        """Waking from idle (``cv`` held): wait for the rest of a burst, unless recent wake-ups
        show requests come one at a time, or ``done()`` says not to wait (closing, a deadline)."""
        now = time.monotonic()
        if not self.waiting:
            self._skipped_at = now
            return
        self._skipped_at = None
        first = seen = self.count
        deadline = now + ARRIVAL_WINDOW_S
        while not done():
            left = deadline - time.monotonic()
            if left <= 0:
                break
            cv.wait(min(ARRIVAL_QUIET_S, left))
            if self.count == seen:  # quiet for a moment: the burst is in
                break
            seen = self.count
        self._lone = 0 if self.count > first else self._lone + 1
