"""The event hub behind ``GET /events``: what the scheduler did, for any number of watchers, at no
cost to the ticks.

**Watching costs nothing.** The model's thread does one thing for the hub after a tick: it
appends a small tuple to a bounded deque (:meth:`EventHub.superfluid_tick_done`; a few
microseconds, measured in tests/unit/test_events_hub.py). Everything else happens on the event
loop: once per interval a *channel* (the readers that asked for the same interval and model)
drains that deque, reads each model's scheduler the way ``/slots`` does (its lock held for the
copy only), builds one snapshot and encodes it once for all its readers. Readers never touch
the scheduler.

**A slow reader costs itself, not others.** Each reader has a one-slot mailbox: a snapshot that
arrives before the previous one was taken replaces it, the reader's ``coalesced`` count says how
many it missed, and the replaced snapshots' ticks are carried into the next one it gets (up to
:data:`MAX_TICKS`), so its timeline has no hole. A reader's writes are its own task's: a socket
that does not drain blocks only that task, and one that makes no progress for ``stall_s``
seconds is dropped (logged). At most ``max_readers`` streams are open; one more is a 503.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import time
from typing import Iterable

from superfluid.core import qos as qos_classes
from superfluid.core.errors import ServiceUnavailable
from superfluid.core.hookspecs import hookimpl

from .key_tally import KeyTally
from .readers import MAX_TICKS, Channel, Reader, dumps, event

log = logging.getLogger("superfluid.http")

VERSION = 1
TICK_RING = 4096       # ticks waiting for the next snapshot, all models (the oldest drop first)
TICK_HISTORY = 1024    # ticks kept per model once drained, for channels built less often
TTFT_WINDOW_S = 300.0  # "recent" TTFT: first tokens of the last five minutes ...
TTFT_SAMPLES = 1000    # ... at most this many per class
MAX_READERS = 64
STALL_S = 30.0         # a reader whose socket takes no data for this long is dropped
PING_S = 15.0          # a ping when nothing else was sent for this long
INTERVAL_MS = (100, 5000, 500)  # min, max, default

# one tick as the model's thread leaves it: (model, seq, at, seconds, target_s, prefill, decode,
# lanes, stopped_early, first_tokens)
_TICK_FIELDS = ("seq", "at", "seconds", "target_s", "prefill_tokens", "decode_tokens", "lanes", "stopped_early")


PING = b"event: ping\ndata: {}\n\n"


class TooManyReaders(ServiceUnavailable):
    code = "too_many_readers"


def percentile(sorted_values: list[float], q: float) -> float | None:
    """The nearest-rank percentile of already sorted values (None for none)."""
    if not sorted_values:
        return None
    rank = max(1, min(len(sorted_values), int(-(-q * len(sorted_values) // 100))))
    return round(sorted_values[rank - 1], 4)


class EventHub:
    """Collects ticks (the model threads) and serves snapshots (the event loop).

    ``daemon``: its ``models`` (name -> runtime with ``.loop.snapshot()``); ``policy``: the
    :class:`~..keys.policy.PolicyFile` (None: no key policy, no ``keys`` in snapshots)."""

    def __init__(self, daemon, policy=None, *, max_readers: int = MAX_READERS, stall_s: float = STALL_S,
                 ping_s: float = PING_S, clock=time.time):
        self.daemon, self.policy = daemon, policy
        self.max_readers, self.stall_s, self.ping_s = max_readers, stall_s, ping_s
        self.clock = clock
        self.keys = KeyTally()
        self.ring: collections.deque = collections.deque(maxlen=TICK_RING)
        self._seqs: dict[str, itertools.count] = {}
        self.preemptions: dict[str, int] = {}
        self.requests: dict[str, int] = {}
        self._history: dict[str, collections.deque] = {}
        self._ttft: dict[str, dict[str, collections.deque]] = {}
        self.channels: dict[tuple[int, str | None], Channel] = {}
        self.readers = 0
        self.dropped = 0  # readers dropped for not draining
        self.closing = False
        self._all: set[Reader] = set()

    # ---- the model threads: as little as possible --------------------------------------------

    @hookimpl
    def superfluid_tick_done(self, model, stats):
        seqs = self._seqs.get(model)
        if seqs is None:
            seqs = self._seqs[model] = itertools.count(1)
        self.ring.append((model, next(seqs), time.time(), stats.seconds, stats.target_s,
                          stats.prefill_tokens, stats.decode_tokens, stats.lanes_busy, stats.stopped_early,
                          stats.first_tokens))
        if stats.preempted:
            self.preemptions[model] = self.preemptions.get(model, 0) + stats.preempted

    @hookimpl
    def superfluid_lane_finished(self, model, lane):
        self.requests[model] = self.requests.get(model, 0) + 1

    # ---- the event loop ----------------------------------------------------------------------

    def _drain(self) -> None:
        """Move the ticks the model threads left into per-model history and TTFT windows."""
        ring = self.ring
        while True:
            try:
                model, *tick, first_tokens = ring.popleft()
            except IndexError:
                return
            history = self._history.get(model)
            if history is None:
                history = self._history[model] = collections.deque(maxlen=TICK_HISTORY)
            history.append(tick)
            if first_tokens:
                windows = self._ttft.setdefault(model, {})
                at = tick[1]
                for cls, seconds in first_tokens:
                    window = windows.get(cls)
                    if window is None:
                        window = windows[cls] = collections.deque(maxlen=TTFT_SAMPLES)
                    window.append((at, seconds))

    def _ticks(self, model: str, since: dict[str, int]) -> list[dict]:
        history = self._history.get(model, ())
        last = since.get(model, 0)
        fresh = [t for t in itertools.islice(reversed(history), MAX_TICKS) if t[0] > last]
        fresh.reverse()
        if history:
            since[model] = history[-1][0]
        out = []
        for seq, at, seconds, target, prefill, decode, lanes, early in fresh:
            out.append({"seq": seq, "at": round(at, 4), "seconds": round(seconds, 5),
                        "target_s": round(target, 5) if target else None, "prefill_tokens": prefill,
                        "decode_tokens": decode, "lanes": lanes, "stopped_early": bool(early)})
        return out

    def _ttft_view(self, model: str, now: float) -> dict:
        windows = self._ttft.get(model, {})
        out = {}
        for cls in _classes(windows):
            window = windows.get(cls, ())
            while window and now - window[0][0] > TTFT_WINDOW_S:
                window.popleft()
            values = sorted(s for _, s in window)
            out[cls] = {"count": len(values), "p50": percentile(values, 50), "p95": percentile(values, 95),
                        "p99": percentile(values, 99)}
        return out

    def model_view(self, name: str, slots: dict, since: dict[str, int], now: float) -> dict:
        """One model's part of a snapshot, from its /slots view (``scheduler.snapshot()``)."""
        lanes = [_lane(slot) for slot in slots["slots"]]
        queues = {cls: {"count": 0, "oldest_wait_s": 0.0, "parked": 0} for cls in qos_classes.CLASSES}
        for waiting in slots.get("queue", ()):
            q = queues.setdefault(waiting["qos"], {"count": 0, "oldest_wait_s": 0.0, "parked": 0})
            q["count"] += 1
            q["oldest_wait_s"] = max(q["oldest_wait_s"], waiting.get("waited_s", 0.0))
            q["parked"] += bool(waiting.get("parked"))
        used, capacity = slots.get("kv_used", 0), slots.get("kv_capacity", 0)
        history = self._history.get(name)
        return {
            "lanes": lanes,
            "queues": queues,
            "kv": {"used": used, "capacity": capacity,
                   "occupancy": round(used / capacity, 4) if capacity else 0.0,
                   "cached_tokens": slots.get("kv_cached", 0), "host_bytes": slots.get("host_cache_bytes", 0),
                   "host_entries": slots.get("host_cache_entries", 0), "parked_bytes": slots.get("parked_bytes", 0),
                   "pinned_prefixes": slots.get("pinned_prefixes", 0)},
            "pressure": slots.get("pressure", "ok"),
            "ticks": self._ticks(name, since),
            "ttft": self._ttft_view(name, now),
            "preemptions_total": self.preemptions.get(name, 0),
            "requests_total": self.requests.get(name, 0),
            "queued": slots.get("queued", 0),
            "max_batch": slots.get("max_batch", len(lanes)),  # lanes may run in any of more slots
            "ticks_total": slots.get("ticks", history[-1][0] if history else 0),
        }

    def build(self, model: str | None, since: dict[str, int]) -> dict:
        """A snapshot's data for one model (or all): read each scheduler briefly, under its lock."""
        self._drain()
        now = self.clock()
        models = {}
        for name, rt in list(self.daemon.models.items()):
            if model is not None and name != model:
                continue
            models[name] = self.model_view(name, rt.loop.snapshot(), since, now)
        data = {"models": models}
        policy = self.policy.current if self.policy is not None else None
        if policy is not None:
            data["keys"] = self.keys.view(policy.keys)
        return data

    def hello(self, interval_ms: int) -> bytes:
        return event("hello", dumps({"version": VERSION, "server": "superfluid", "models": list(self.daemon.models),
                                     "interval_ms": interval_ms, "keys": self.policy is not None}))

    def open(self, interval_ms: int, model: str | None) -> Reader:
        """A new reader on its channel (started if new), with the channel's latest snapshot
        waiting for it (a new channel builds its first at once). 503 beyond ``max_readers``."""
        if self.closing:
            raise ServiceUnavailable("the server is shutting down", code="shutting_down",
                                     headers={"Retry-After": "5"})
        if self.readers >= self.max_readers:
            raise TooManyReaders(f"{self.max_readers} /events streams are open already, the most this server "
                                 "allows; retry later", headers={"Retry-After": "5"})
        key = (interval_ms, model)
        channel = self.channels.get(key)
        fresh = channel is None
        if fresh:
            channel = self.channels[key] = Channel(self, interval_ms, model)
        reader = Reader(channel)
        channel.readers.add(reader)
        self._all.add(reader)
        self.readers += 1
        try:
            reader.offer(channel.build() if fresh or channel.latest is None else channel.latest)
        except Exception:
            self.close(reader)
            raise
        if channel.task is None or channel.task.done():
            channel.task = asyncio.get_running_loop().create_task(channel.run(), name=f"events-{key}")
        return reader

    def close(self, reader: Reader) -> None:
        channel = reader.channel
        if reader in self._all:
            self._all.discard(reader)
            self.readers -= 1
        channel.readers.discard(reader)
        if not channel.readers and self.channels.get((channel.interval_ms, channel.model)) is channel:
            del self.channels[(channel.interval_ms, channel.model)]  # its task sees no readers and ends

    async def shutdown(self, app=None) -> None:
        """The server stops: every stream ends (an ``on_shutdown`` callback)."""
        self.closing = True
        for reader in list(self._all):
            reader.ready.set()
        for channel in list(self.channels.values()):
            if channel.task is not None:
                channel.task.cancel()

    def watch(self, readers: Iterable[Reader], now: float) -> None:
        """Each interval, on the channel's task: drop a reader whose write has not finished for
        ``stall_s`` (its socket does not drain), and give one that was sent nothing for ``ping_s``
        a ping. No timer per write or per wait: a stream costs its writes and nothing more."""
        for reader in list(readers):
            if reader.writing_since is not None and now - reader.writing_since > self.stall_s:
                self._drop(reader)
            elif reader.pending is None and reader.writing_since is None and now - reader.last_sent >= self.ping_s:
                reader.ping = True
                reader.ready.set()

    def _drop(self, reader: Reader) -> None:
        if reader.dropped:
            return
        reader.dropped = True
        self.dropped += 1
        log.warning("events: dropped the /events reader %s: its socket took nothing for %.0f s",
                    reader.peer, self.stall_s)
        if reader.abort is not None:
            reader.abort()
        if reader.task is not None:
            reader.task.cancel()
        self.close(reader)

    async def stream(self, reader: Reader, write, transport_abort=None, peer: str = "-") -> None:
        """Write ``reader``'s snapshots with ``write`` (a coroutine function taking bytes) until
        the client leaves, the server stops, or the socket stalls for ``stall_s`` seconds (then
        the connection is aborted and this task cancelled, see :meth:`watch`)."""
        loop = asyncio.get_running_loop()
        reader.task, reader.abort, reader.peer = asyncio.current_task(), transport_abort, peer
        reader.last_sent = loop.time()
        try:
            while not self.closing:
                await reader.ready.wait()
                payload = reader.take()
                if payload is None:
                    if not reader.ping:
                        continue
                    reader.ping, payload = False, PING
                reader.writing_since = loop.time()
                await write(payload)
                reader.writing_since = None
                reader.last_sent = loop.time()
        finally:
            self.close(reader)


def _classes(windows: dict) -> list[str]:
    return list(qos_classes.CLASSES) + [c for c in windows if c not in qos_classes.CLASSES]


def _lane(slot: dict) -> dict:
    """One /slots slot as the stream's lane."""
    state = slot.get("state", "free")
    rate = slot.get("decode_tokens_per_s")
    if rate is None:
        rate = slot.get("prefill_tokens_per_s")
    return {"id": slot["id"], "state": state, "qos": slot.get("qos"), "request_id": slot.get("request_id"),
            "prompt_tokens": slot.get("prompt_tokens", 0), "cached_tokens": slot.get("cached_tokens", 0),
            "prefilled_tokens": slot.get("prefilled_tokens", 0), "generated_tokens": slot.get("generated_tokens", 0),
            "max_tokens": slot.get("max_tokens"), "tokens_per_s": rate, "preemptions": slot.get("preemptions", 0)}
