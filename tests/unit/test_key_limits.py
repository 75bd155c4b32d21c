"""plugins/http/keys/limits.py with a fake clock: requests- and tokens-per-minute buckets, lanes,
the 429s' Retry-After and x-ratelimit-* headers, reloads, pruning and the per-key metrics.
No server, no model."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from superfluid.plugins.http.info.metrics import Metrics
from superfluid.plugins.http.keys import limits as kl
from superfluid.plugins.http.keys.limits import KeyLimits, TooManyConcurrent, duration
from superfluid.plugins.http.keys.policy import Key
from superfluid.plugins.http.keys.rate_limit import RateLimited


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def key(name="k", **limits) -> Key:
    return Key(name=name, sha256="0" * 64, **limits)


@pytest.fixture
def clock():
    return Clock()


def limits_for(clock, metrics=None) -> KeyLimits:
    return KeyLimits(clock=clock, metrics=metrics)


def test_duration_format():
    assert [duration(s) for s in (0, -1, 0.0004, 0.25, 1, 6.2, 60, 61.5, 3600)] == \
        ["0s", "0s", "1ms", "250ms", "1s", "7s", "1m0s", "1m2s", "60m0s"]


def test_requests_per_minute_burst_then_refill(clock):
    limits, k = limits_for(clock), key(requests_per_minute=3)
    for remaining in (2, 1, 0):
        limits.admit(k, 10).end(5)
        assert limits.headers(k)["x-ratelimit-remaining-requests"] == str(remaining)
    with pytest.raises(RateLimited) as exc:
        limits.admit(k, 10)
    err = exc.value
    assert err.status == 429 and err.code == "rate_limit_exceeded" and err.type == "rate_limit_error"
    assert err.headers["Retry-After"] == "20"  # one request every 20 s at 3 a minute
    assert err.headers["x-ratelimit-limit-requests"] == "3"
    assert err.headers["x-ratelimit-remaining-requests"] == "0"
    assert err.headers["x-ratelimit-reset-requests"] == "1m0s"
    assert "requests per minute" in err.message and "'k'" in err.message
    assert "x-ratelimit-limit-tokens" not in err.headers  # no tokens-per-minute on this key
    clock.now += 19.5
    with pytest.raises(RateLimited) as exc:
        limits.admit(k, 10)
    assert exc.value.headers["Retry-After"] == "1"
    clock.now += 0.5
    limits.admit(k, 10).end()
    clock.now += 600  # refilled to the limit, not beyond
    assert limits.headers(k)["x-ratelimit-remaining-requests"] == "3"


def test_another_key_is_unaffected(clock):
    limits, a, b = limits_for(clock), key("a", requests_per_minute=1), key("b", requests_per_minute=1)
    limits.admit(a, 1).end()
    with pytest.raises(RateLimited):
        limits.admit(a, 1)
    limits.admit(b, 1).end()


def test_tokens_prompt_at_admission_completion_at_the_end(clock):
    limits, k = limits_for(clock), key(tokens_per_minute=100)
    t = limits.admit(k, 30)
    assert limits.headers(k)["x-ratelimit-remaining-tokens"] == "70"
    t.end(20)
    t.end(20)  # twice is once
    assert limits.headers(k)["x-ratelimit-remaining-tokens"] == "50"
    limits.admit(k, 30).end(20)  # 0 left
    with pytest.raises(RateLimited) as exc:
        limits.admit(k, 30)
    err = exc.value
    assert err.code == "rate_limit_exceeded" and "tokens per minute" in err.message
    assert err.headers["Retry-After"] == "18"  # 30 tokens at 100/60 per second
    assert err.headers["x-ratelimit-limit-tokens"] == "100"
    assert err.headers["x-ratelimit-remaining-tokens"] == "0"
    assert err.headers["x-ratelimit-reset-tokens"] == "1m0s"
    clock.now += 18
    limits.admit(k, 30).end(0)


def test_completions_may_overdraw_and_the_debt_delays(clock):
    limits, k = limits_for(clock), key(tokens_per_minute=60)
    a, b = limits.admit(k, 10), limits.admit(k, 10)  # both pass on their prompts
    a.end(50)
    b.end(50)  # 60 - 120 = -60
    assert limits.headers(k)["x-ratelimit-remaining-tokens"] == "0"
    with pytest.raises(RateLimited) as exc:
        limits.admit(k, 10)
    assert exc.value.headers["Retry-After"] == "70"  # 70 tokens short at 1 a second
    assert limits.headers(k)["x-ratelimit-reset-tokens"] == "2m0s"


def test_a_prompt_bigger_than_the_budget_needs_a_full_bucket(clock):
    limits, k = limits_for(clock), key(tokens_per_minute=60)
    limits.admit(k, 500).end(0)  # full bucket: passes, and leaves a debt
    with pytest.raises(RateLimited) as exc:
        limits.admit(k, 500)
    assert exc.value.headers["Retry-After"] == str(440 + 60)  # back to full: 500 seconds
    clock.now += 500
    limits.admit(k, 500).end()


def test_refused_submit_refunds_the_prompt(clock):
    limits, k = limits_for(clock), key(tokens_per_minute=100, requests_per_minute=10)
    limits.admit(k, 80).end(0, refund_prompt=True)
    h = limits.headers(k)
    assert h["x-ratelimit-remaining-tokens"] == "100" and h["x-ratelimit-remaining-requests"] == "9"


def test_lanes(clock):
    limits, k = limits_for(clock), key(lanes=2)
    a, b = limits.admit(k, 1), limits.admit(k, 1)
    assert limits.in_flight(k) == 2
    with pytest.raises(TooManyConcurrent) as exc:
        limits.admit(k, 1)
    err = exc.value
    assert err.status == 429 and err.code == "too_many_concurrent_requests" and err.headers["Retry-After"] == "1"
    assert "lanes = 2" in err.message
    assert limits.headers(k) == {}  # no per-minute limits: no x-ratelimit-* headers
    a.end()
    a.end()  # ending twice frees one slot only
    c = limits.admit(k, 1)
    with pytest.raises(TooManyConcurrent):
        limits.admit(k, 1)
    b.end()
    c.end()
    assert limits.in_flight(k) == 0


def test_a_refusal_takes_nothing(clock):
    """A request refused by one limit is not charged by the others."""
    limits, k = limits_for(clock), key(requests_per_minute=5, tokens_per_minute=10, lanes=1)
    held = limits.admit(k, 5)
    with pytest.raises(TooManyConcurrent):
        limits.admit(k, 5)
    held.end(5)
    with pytest.raises(RateLimited):
        limits.admit(k, 5)  # tokens: 0 left
    h = limits.headers(k)
    assert h["x-ratelimit-remaining-requests"] == "4" and limits.in_flight(k) == 0


def test_no_policy_or_no_limits_is_never_refused(clock):
    limits = limits_for(clock)
    for _ in range(1000):
        limits.admit(None, 10 ** 6).end(10 ** 6)
        limits.admit(key(), 10 ** 6).end(10 ** 6)
    assert limits.headers(None) == {} and limits.headers(key()) == {}
    assert not limits._states  # unlimited keys keep no state


def test_a_reload_that_changes_the_limit(clock):
    limits = limits_for(clock)
    limits.admit(key(requests_per_minute=10), 1).end()
    tighter = key(requests_per_minute=2)
    h = limits.headers(tighter)
    assert h["x-ratelimit-limit-requests"] == "2" and h["x-ratelimit-remaining-requests"] == "2"  # capped
    limits.admit(tighter, 1).end()
    limits.admit(tighter, 1).end()
    with pytest.raises(RateLimited):
        limits.admit(tighter, 1)
    assert limits.headers(key()) == {}  # limits removed: no headers


def test_pruned_when_large(clock, monkeypatch):
    monkeypatch.setattr(kl, "PRUNE_AT", 8)
    limits = limits_for(clock)
    busy = limits.admit(key("busy", lanes=1), 1)
    for i in range(7):
        limits.admit(key(f"k{i}", requests_per_minute=60), 1).end()
    clock.now += 2  # every per-minute bucket is full again
    limits.admit(key("new", requests_per_minute=60), 1).end()
    assert set(limits._states) == {"busy", "new"}  # in flight is kept
    busy.end()


def samples(metrics: Metrics) -> dict[tuple, float]:
    text = metrics.render().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_metrics_per_key_name(clock):
    metrics = Metrics()
    limits = limits_for(clock, metrics)
    k = key("chat-ui", requests_per_minute=1, lanes=1)
    limits.admit(k, 12).end(7)
    limits.admit(None, 3).end(2)
    with pytest.raises(RateLimited):
        limits.admit(k, 12)
    clock.now += 60
    held = limits.admit(k, 12)
    assert samples(metrics)[("superfluid_key_in_flight", (("key", "chat-ui"),))] == 1
    with pytest.raises(TooManyConcurrent):
        limits.admit(k, 12)
    held.end(0, refund_prompt=True)
    s = samples(metrics)
    assert s[("superfluid_key_in_flight", (("key", "chat-ui"),))] == 0
    assert s[("superfluid_key_requests_total", (("key", "chat-ui"),))] == 2
    assert s[("superfluid_key_requests_total", (("key", "-"),))] == 1
    assert s[("superfluid_key_tokens_total", (("key", "chat-ui"), ("kind", "prompt")))] == 12  # one refunded
    assert s[("superfluid_key_tokens_total", (("key", "chat-ui"), ("kind", "completion")))] == 7
    assert s[("superfluid_key_tokens_total", (("key", "-"), ("kind", "prompt")))] == 3
    assert s[("superfluid_key_rejections_total", (("key", "chat-ui"), ("reason", "requests_per_minute")))] == 1
    assert s[("superfluid_key_rejections_total", (("key", "chat-ui"), ("reason", "lanes")))] == 1
