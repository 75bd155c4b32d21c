"""The token bucket every rate limit of the front end uses, and the 429 they answer.

Two limits use it: a key's per-minute budgets (:mod:`.limits`: requests and tokens, each a bucket
of the minute's limit refilled at limit/60 a second) and each client's fill-in-the-middle
requests (--completion-rate, --completion-burst: :class:`ClientBuckets`, for
:mod:`..prepare.fim`), since an editor fires a completion per keystroke and one client must not
flood the completion class while a burst still gets through.

A bucket is two floats (its level and when it was last refilled), refilled continuously, so each
request costs O(1), a burst of up to the bucket's size passes at once, and the time until a
refused request would pass (``Retry-After``) is exact: the missing amount over the refill rate."""

from __future__ import annotations

import math
import time

from superfluid.core.errors import SuperfluidError


class RateLimited(SuperfluidError):
    status = 429
    type = "rate_limit_error"
    code = "rate_limit_exceeded"  # what OpenAI answers for requests and tokens per minute


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


class TokenBucket:
    """Up to ``size`` tokens, refilled at ``rate`` a second; full when made at ``now``. Callers
    refill it to the present before asking (:meth:`refill`), then take by lowering ``level``."""

    __slots__ = ("size", "rate", "level", "stamp")

    def __init__(self, size: int, rate: float, now: float):
        self.size, self.rate, self.level, self.stamp = size, rate, float(size), now

    def refill(self, now: float) -> None:
        self.level = min(float(self.size), self.level + max(0.0, now - self.stamp) * self.rate)
        self.stamp = now

    def wait(self, need: float) -> float:
        """Seconds until ``need`` (capped at the size) is in the bucket; 0 if it is now."""
        need = min(need, float(self.size))
        if self.level >= need:
            return 0.0
        return (need - self.level) / self.rate

    def reset(self) -> float:
        """Seconds until the bucket is full again."""
        return max(0.0, (self.size - self.level) / self.rate)


class ClientBuckets:
    """One bucket per client, all of one size and rate; a client's first request finds its
    bucket full."""

    def __init__(self, rate: float, burst: int, clock=time.monotonic):
        self.rate = rate
        self.burst = burst
        self._clock = clock
        self._buckets: dict[str, TokenBucket] = {}

    def take(self, client: str) -> float:
        """Take one token; 0.0 if allowed, else the seconds until one is available."""
        now = self._clock()
        bucket = self._buckets.get(client)
        if bucket is None:
            bucket = self._buckets[client] = TokenBucket(self.burst, self.rate, now)
        bucket.refill(now)
        wait = bucket.wait(1.0)
        if wait == 0.0:
            bucket.level -= 1.0
            self._prune(now)
        return wait

    def _prune(self, now: float) -> None:
        """Forget clients whose bucket is full again, so the table stays small."""
        if len(self._buckets) > 4096:
            full = self.burst / self.rate
            self._buckets = {c: b for c, b in self._buckets.items() if now - b.stamp < full}
