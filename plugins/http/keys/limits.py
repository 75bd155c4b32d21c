"""Per-key limits of a key policy: requests-per-minute, tokens-per-minute and concurrent lanes.

**Token buckets, not windows.** Each limited key has one bucket per budget
(:class:`.rate_limit.TokenBucket`, the front end's one token bucket), holding up to the
per-minute limit and refilled continuously at limit/60 per second: state is two floats per
bucket, each request costs O(1) (no log of timestamps, as a sliding window would need), a burst
of up to the whole minute's budget passes at once, and the time until a refused request would
pass (``Retry-After``) is exact: the missing amount over the refill rate. A fixed window would
let twice the limit through within a few seconds across a window boundary; a bucket lets at most
the limit through at once, then limit/60 a second.

Only what runs on an engine is limited: generations (chat, completions, infill, and session
turns, which are chats) and embeddings (one request: one lane slot, its inputs' prompt tokens, no
completion tokens). The other routes cost no engine time.

**Tokens are charged when known.** A generation needs its prompt's tokens in the bucket to be
admitted (a prompt bigger than the whole budget needs a full bucket, so no request is refused
forever) and is charged them then; its completion tokens are charged when it ends, whatever the
outcome: a client that goes away pays for the tokens that had reached its handler (a stream's
sent so far; a whole reply's are held to its end, so none); a request the scheduler refuses on
submit (context, queue full) gets its prompt's tokens back but still counts as a request.
Charging ``max_tokens`` up front and refunding instead would make every chat without
``max_tokens`` (the rest of the context, by OpenAI's default) wait for a nearly full bucket.
The price: requests in flight together may overdraw the bucket by their completions (at most
``lanes`` times ``max-tokens`` with both set); the debt delays the key's next requests until it
is refilled, and a Retry-After given while others are in flight cannot foresee their debt.

**Lanes** count a key's generations in flight, queued or admitted; a slot is taken when a request
passes and given back when it ends (finished, failed, or its client gone).

One :class:`KeyLimits` serves the front end, on the event loop; a lock keeps it safe anyway. Its
table is keyed by key name (a policy's keys are few) and pruned of idle, refilled entries when it
grows. A SIGHUP that changes a key's limits takes effect at its next request (the bucket keeps
its level, capped at the new limit)."""

from __future__ import annotations

import math
import threading
import time

from aiohttp import web

from .rate_limit import RateLimited, TokenBucket

# request[HEADERS]: (KeyLimits, Key) for the x-ratelimit-* headers (a typed key: aiohttp warns on a string)
HEADERS = web.RequestKey("superfluid.ratelimit", tuple)
NO_KEY = "-"  # the key label of requests without a key policy
PRUNE_AT = 1024


class TooManyConcurrent(RateLimited):
    """A key's ``lanes`` are all in flight. Its own code, not ``rate_limit_exceeded``: a client
    told this should wait for one of its own requests to end, not for a minute's budget."""

    code = "too_many_concurrent_requests"


def duration(seconds: float) -> str:
    """OpenAI's x-ratelimit-reset-* format: ``"1m0s"``, ``"6s"``, ``"250ms"``, ``"0s"``."""
    if seconds <= 0:
        return "0s"
    if seconds < 1:
        return f"{max(1, math.ceil(seconds * 1000))}ms"
    minutes, rest = divmod(math.ceil(seconds), 60)
    return f"{minutes}m{rest}s" if minutes else f"{rest}s"


def per_minute(limit: int, now: float) -> TokenBucket:
    """A per-minute budget: ``limit`` tokens, refilled at limit/60 a second."""
    return TokenBucket(limit, limit / 60.0, now)


def refill(bucket: TokenBucket, now: float, limit: int) -> None:
    """Refill a budget to ``now`` under ``limit``, which a reloaded policy may have changed: the
    level stays, capped at the new limit, and refills at the new rate."""
    if limit != bucket.size:
        bucket.size, bucket.rate = limit, limit / 60.0
    bucket.refill(now)


class _State:
    __slots__ = ("requests", "tokens", "in_flight", "seen")

    def __init__(self, now: float):
        self.requests: TokenBucket | None = None
        self.tokens: TokenBucket | None = None
        self.in_flight = 0
        self.seen = now


def limited(key) -> bool:
    return key is not None and bool(key.requests_per_minute or key.tokens_per_minute or key.lanes)


class Ticket:
    """A request that passed: :meth:`end` (once, whatever the outcome) charges its completion
    and gives its lane slot back."""

    __slots__ = ("limits", "key", "prompt", "ended")

    def __init__(self, limits: "KeyLimits", key, prompt: int):
        self.limits, self.key, self.prompt, self.ended = limits, key, prompt, False

    def end(self, completion_tokens: int = 0, *, refund_prompt: bool = False) -> None:
        if self.ended:
            return
        self.ended = True
        self.limits._end(self, completion_tokens, refund_prompt)


class KeyLimits:
    """The buckets and lane counts of every key; ``metrics`` (optional) counts per key name."""

    def __init__(self, clock=time.monotonic, metrics=None):
        self._clock = clock
        self._lock = threading.Lock()
        self._states: dict[str, _State] = {}
        self.metrics = metrics

    def _state(self, key, now: float) -> _State:
        state = self._states.get(key.name)
        if state is None:
            if len(self._states) >= PRUNE_AT:
                self._prune(now)
            state = self._states[key.name] = _State(now)
        state.seen = now
        for attr, limit in (("requests", key.requests_per_minute), ("tokens", key.tokens_per_minute)):
            bucket = getattr(state, attr)
            if not limit:
                setattr(state, attr, None)
            elif bucket is None:
                setattr(state, attr, per_minute(limit, now))
            else:
                refill(bucket, now, limit)
        return state

    def _prune(self, now: float) -> None:
        """Forget keys with nothing in flight whose buckets would be full by now."""
        def idle(s: _State) -> bool:
            return s.in_flight == 0 and all(b is None or now - b.stamp >= b.reset() for b in (s.requests, s.tokens))
        self._states = {name: s for name, s in self._states.items() if not idle(s)}

    def admit(self, key, prompt_tokens: int) -> Ticket:
        """Take a lane slot, a request and the prompt's tokens for ``key`` (None: no policy,
        nothing limited), or raise :class:`RateLimited` with ``Retry-After`` and the
        x-ratelimit-* headers. Nothing is taken unless everything passes."""
        label = key.name if key is not None else NO_KEY
        if not limited(key):
            self._count(label, prompt_tokens)
            return Ticket(self, key, prompt_tokens)
        with self._lock:
            now = self._clock()
            state = self._state(key, now)
            reason, retry, message = None, 0.0, ""
            if key.lanes and state.in_flight >= key.lanes:
                reason, retry = "lanes", 1.0
                message = (f"key {key.name!r} already has {state.in_flight} requests in flight, its limit "
                           f"(lanes = {key.lanes}); retry when one of them ends")
            elif state.requests is not None and state.requests.wait(1) > 0:
                reason, retry = "requests_per_minute", state.requests.wait(1)
                message = (f"Rate limit reached for key {key.name!r} on requests per minute: "
                           f"limit {key.requests_per_minute}; retry in {duration(retry)}")
            elif state.tokens is not None and state.tokens.wait(prompt_tokens) > 0:
                reason, retry = "tokens_per_minute", state.tokens.wait(prompt_tokens)
                message = (f"Rate limit reached for key {key.name!r} on tokens per minute: limit "
                           f"{key.tokens_per_minute}, available {max(0, int(state.tokens.level))}, "
                           f"requested {prompt_tokens} (prompt); retry in {duration(retry)}")
            if reason is None:
                state.in_flight += 1
                if state.requests is not None:
                    state.requests.level -= 1
                if state.tokens is not None:
                    state.tokens.level -= prompt_tokens
            headers = self._headers(key, state)
            if reason is None and self.metrics is not None:
                self.metrics.key_busy(label, state.in_flight)
        if reason is not None:
            if self.metrics is not None:
                self.metrics.key_rejected(label, reason)
            raise (TooManyConcurrent if reason == "lanes" else RateLimited)(
                message, headers={"Retry-After": str(max(1, math.ceil(retry))), **headers})
        self._count(label, prompt_tokens)
        return Ticket(self, key, prompt_tokens)

    def _count(self, label: str, prompt_tokens: int) -> None:
        if self.metrics is not None:
            self.metrics.key_admitted(label)

    def _end(self, ticket: Ticket, completion_tokens: int, refund_prompt: bool) -> None:
        key = ticket.key
        label = key.name if key is not None else NO_KEY
        if self.metrics is not None:
            self.metrics.key_finished(label, 0 if refund_prompt else ticket.prompt, completion_tokens)
        if not limited(key):
            return
        with self._lock:
            state = self._states.get(key.name)
            if state is None:
                return
            state.in_flight = max(0, state.in_flight - 1)
            if state.tokens is not None:
                state.tokens.refill(self._clock())
                state.tokens.level -= completion_tokens
                if refund_prompt:
                    state.tokens.level = min(float(state.tokens.size), state.tokens.level + ticket.prompt)
            if self.metrics is not None:
                self.metrics.key_busy(label, state.in_flight)

    def in_flight(self, key) -> int:
        state = self._states.get(key.name) if key is not None else None
        return state.in_flight if state is not None else 0

    def headers(self, key) -> dict[str, str]:
        """The x-ratelimit-* headers of ``key`` now (empty for a key without per-minute limits)."""
        if key is None or not (key.requests_per_minute or key.tokens_per_minute):
            return {}
        with self._lock:
            return self._headers(key, self._state(key, self._clock()))

    @staticmethod
    def _headers(key, state: _State) -> dict[str, str]:
        out = {}
        for kind, bucket in (("requests", state.requests), ("tokens", state.tokens)):
            if bucket is not None:
                out[f"x-ratelimit-limit-{kind}"] = str(bucket.size)
                out[f"x-ratelimit-remaining-{kind}"] = str(max(0, math.floor(bucket.level)))
                out[f"x-ratelimit-reset-{kind}"] = duration(bucket.reset())
        return out


def response_headers(request) -> dict[str, str]:
    """The x-ratelimit-* headers for a response to ``request`` (empty unless it went through a
    limited key's buckets)."""
    try:
        found = request.get(HEADERS)
    except AttributeError:
        return {}
    if found is None:
        return {}
    limits, key = found
    return limits.headers(key)
