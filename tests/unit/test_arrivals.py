"""The arrival window learns whether waiting for a burst pays (core/arrivals.py), driven through
its public methods with a condition variable that records its waits and may bring arrivals."""

from __future__ import annotations

import time

from superfluid.core.arrivals import ARRIVAL_WINDOW_S, LONE_WAKES, ArrivalWindow


class RecordingCondition:
    """Stands in for the loop's lock: ``wait`` records its timeout and lets ``arrive`` requests
    come in meanwhile, as other threads' submits would."""

    def __init__(self, window: ArrivalWindow, arrive: int = 0):
        self.window, self.arrive, self.waits = window, arrive, []

    def wait(self, timeout=None):
        self.waits.append(timeout)
        if self.arrive:
            self.arrive -= 1
            self.window.arrived(time.monotonic())


def wake(window: ArrivalWindow, arrive: int = 0) -> int:
    """One wake-up from idle for a first request (already arrived); the waits it made. The
    request comes well after the previous wake-up, as one that follows a finished reply does."""
    window.arrived(time.monotonic() + 2 * ARRIVAL_WINDOW_S)
    cv = RecordingCondition(window, arrive)
    window.gather(cv, lambda: False)
    return len(cv.waits)


def test_a_burst_is_gathered_until_a_quiet_gap():
    window = ArrivalWindow()
    assert wake(window, arrive=3) == 4  # three arrivals, then one quiet wait ends it
    assert window.count == 4 and window.waiting


def test_requests_one_at_a_time_stop_paying_for_the_wait():
    window = ArrivalWindow()
    for _ in range(LONE_WAKES):
        assert window.waiting
        assert wake(window) == 1        # one quiet gap, nobody came
    assert not window.waiting
    assert wake(window) == 0            # a lone request now starts at once
    assert wake(window) == 0


def test_a_burst_after_skipped_waits_turns_the_wait_back_on():
    window = ArrivalWindow()
    for _ in range(LONE_WAKES):
        wake(window)
    window.arrived(time.monotonic())    # a lone request: the wake-up does not wait
    window.gather(RecordingCondition(window), lambda: False)
    window.arrived(time.monotonic())    # the burst's second request, within the window
    assert window.waiting
    assert wake(window, arrive=2) == 3


def test_a_later_request_is_not_a_burst():
    window = ArrivalWindow()
    for _ in range(LONE_WAKES):
        wake(window)
    wake(window)
    window.arrived(time.monotonic() + 2 * ARRIVAL_WINDOW_S)  # long after the skipped wake-up
    assert not window.waiting


def test_no_wait_when_told_not_to():
    window = ArrivalWindow()
    window.arrived(time.monotonic())
    cv = RecordingCondition(window)
    window.gather(cv, lambda: True)     # closing, or a request with a start deadline queued
    assert cv.waits == []
