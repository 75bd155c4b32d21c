"""plugins/http/keys/rate_limit.py with a fake clock: the one token bucket behind a key's
per-minute budgets and each client's fill-in-the-middle requests, and the one 429 both answer."""

from __future__ import annotations

import pytest

from superfluid.plugins.http.keys import limits
from superfluid.plugins.http.keys.rate_limit import ClientBuckets, RateLimited, TokenBucket, parse_rate
from superfluid.plugins.http.prepare import fim


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_client_gets_its_burst_then_waits_for_the_refill():
    clock = Clock()
    buckets = ClientBuckets(rate=2.0, burst=3, clock=clock)
    assert [buckets.take("a") for _ in range(3)] == [0.0, 0.0, 0.0]
    assert buckets.take("a") == pytest.approx(0.5)  # a whole token at 2 a second
    assert buckets.take("b") == 0.0  # another client, its own bucket
    clock.now += 0.25
    assert buckets.take("a") == pytest.approx(0.25)  # half a token came back
    clock.now += 0.25
    assert buckets.take("a") == 0.0
    clock.now += 60.0  # refilled to the burst, not past it
    assert [buckets.take("a") for _ in range(4)] == [0.0, 0.0, 0.0, pytest.approx(0.5)]


def test_a_bucket_waits_exactly_for_what_is_missing():
    bucket = TokenBucket(60, 1.0, now=0.0)
    bucket.level -= 60
    assert bucket.wait(10) == pytest.approx(10.0) and bucket.reset() == pytest.approx(60.0)
    bucket.refill(15.0)
    assert bucket.level == pytest.approx(15.0) and bucket.wait(10) == 0.0
    assert bucket.wait(1000) == pytest.approx(45.0)  # more than the bucket holds: wait for a full one


def test_both_limits_share_the_bucket_and_the_429():
    assert isinstance(limits.per_minute(60, 0.0), TokenBucket)
    assert fim.RateLimited is limits.RateLimited is RateLimited
    assert issubclass(limits.TooManyConcurrent, RateLimited)
    err = RateLimited("slow down")
    assert (err.status, err.type, err.code) == (429, "rate_limit_error", "rate_limit_exceeded")


@pytest.mark.parametrize("text, per_second", [("10/s", 10.0), ("600/m", 10.0), ("36/hour", 0.01), ("4", 4.0)])
def test_rates(text, per_second):
    assert parse_rate(text) == pytest.approx(per_second)


@pytest.mark.parametrize("text", ["0/s", "-1/m", "5/day", "inf"])
def test_bad_rates(text):
    with pytest.raises(ValueError):
        parse_rate(text)
