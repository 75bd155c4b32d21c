"""Per-client token buckets for fill-in-the-middle requests (--completion-rate, --completion-burst).

An editor fires a completion per keystroke; the bucket keeps one client from flooding the
completion class while still letting a burst through."""

from __future__ import annotations

import math
import time


def parse_rate(text: str) -> float:
    """``10/s``, ``600/m``, ``10`` (per second) → requests per second."""
    value, _, unit = str(text).strip().partition("/")
    per = {"": 1.0, "s": 1.0, "sec": 1.0, "second": 1.0, "m": 60.0, "min": 60.0, "minute": 60.0,
           "h": 3600.0, "hour": 3600.0}.get(unit.strip().lower())
    if per is None:
        raise ValueError(f"unknown rate unit {unit!r} (use /s, /m or /h)")
    rate = float(value) / per
    if not rate > 0 or math.isinf(rate):
        raise ValueError("the rate must be a positive number")
    return rate


class TokenBuckets:
    def __init__(self, rate: float, burst: int, clock=time.monotonic):
        self.rate = rate
        self.burst = burst
        self._clock = clock
        self._buckets: dict[str, tuple[float, float]] = {}  # client -> (tokens, last refill)

    def take(self, client: str) -> float:
        """Take one token; 0.0 if allowed, else the seconds until one is available."""
        now = self._clock()
        tokens, last = self._buckets.get(client, (float(self.burst), now))
        tokens = min(float(self.burst), tokens + (now - last) * self.rate)
        if tokens >= 1.0:
            self._buckets[client] = (tokens - 1.0, now)
            self._prune(now)
            return 0.0
        self._buckets[client] = (tokens, now)
        return (1.0 - tokens) / self.rate

    def _prune(self, now: float) -> None:
        """Forget clients whose bucket is full again, so the table stays small."""
        if len(self._buckets) > 4096:
            full = self.burst / self.rate
            self._buckets = {c: v for c, v in self._buckets.items() if now - v[1] < full}
