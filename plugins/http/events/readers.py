"""The readers of ``GET /events``: a one-slot mailbox per reader (:class:`Reader`), the snapshot
each channel builds once and encodes once for all its readers (:class:`Snapshot`), and the
channel itself, the readers of one (interval, model) pair with the task that builds their
snapshots on the event loop (:class:`Channel`). A slow reader's replaced snapshots are counted
and their ticks carried into the next one it takes, so its timeline has no hole."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Callable, Iterable, Protocol

log = logging.getLogger("superfluid.http")

MAX_TICKS = 200        # ticks in one snapshot per model (the newest)


def event(kind: str, data: bytes | str) -> bytes:
    """One SSE event: ``event: KIND`` and one ``data:`` line of JSON."""
    if isinstance(data, str):
        data = data.encode()
    return b"event: " + kind.encode() + b"\ndata: " + data + b"\n\n"


def dumps(value) -> str:
    return json.dumps(value, separators=(",", ":"), allow_nan=False)


class Snapshot:
    """One built snapshot of a channel: its data (without the per-reader fields) encoded once."""

    __slots__ = ("seq", "time", "data", "ticks", "body")

    def __init__(self, seq: int, at: float, data: dict):
        self.seq, self.time, self.data = seq, at, data
        self.ticks = {name: model["ticks"] for name, model in data["models"].items()}
        self.body = dumps(data)  # "{...}": the reader's seq, time and coalesced go in front

    def encode(self, coalesced: int, carried: dict | None) -> bytes:
        head = f'{{"seq":{self.seq},"time":{self.time:.3f},"coalesced":{coalesced},'
        if not carried:
            return event("snapshot", head + self.body[1:])
        data = dict(self.data, models={
            name: dict(model, ticks=(carried.get(name, []) + model["ticks"])[-MAX_TICKS:])
            for name, model in self.data["models"].items()})
        return event("snapshot", head + dumps(data)[1:])


class Reader:
    """One open /events stream: a one-slot mailbox of snapshots."""

    __slots__ = ("channel", "pending", "coalesced", "carried", "ready", "sent", "ping", "writing_since",
                 "last_sent", "task", "abort", "peer", "dropped")

    def __init__(self, channel: Channel):
        self.channel = channel
        self.pending: Snapshot | None = None
        self.coalesced = 0            # snapshots replaced before this reader took them, since its last
        self.carried: dict | None = None  # the replaced snapshots' ticks, per model
        self.ready = asyncio.Event()
        self.sent = 0
        self.ping = False             # a ping is due (nothing sent for ping_s)
        self.writing_since: float | None = None  # loop time its write in progress started
        self.last_sent = 0.0
        self.task: asyncio.Task | None = None    # the task writing its stream
        self.abort = None             # closes its connection
        self.peer = "-"
        self.dropped = False

    def offer(self, snap: Snapshot) -> None:
        """A new snapshot: replaces one not yet taken (counted, its ticks carried)."""
        old = self.pending
        if old is not None:
            self.coalesced += 1
            carried = self.carried or {}
            self.carried = {name: (carried.get(name, []) + ticks)[-MAX_TICKS:] for name, ticks in old.ticks.items()}
        self.pending = snap
        self.ready.set()

    def take(self) -> bytes | None:
        """The pending snapshot as an SSE event (None if none), and the mailbox emptied."""
        snap = self.pending
        self.ready.clear()
        if snap is None:
            return None
        out = snap.encode(self.coalesced, self.carried)
        self.pending, self.coalesced, self.carried = None, 0, None
        self.sent += 1
        return out


class Source(Protocol):
    """What a channel asks of the hub that made it (``hub.EventHub``): the snapshot of one model
    (or all) since the tick seqs given, the clock, and a look at its readers after each round.
    Named here so this module does not import the hub, which imports it."""

    clock: Callable[[], float]

    def build(self, model: str | None, since: dict[str, int]) -> dict: ...

    def watch(self, readers: Iterable[Reader], now: float) -> None: ...


class Channel:
    """The readers of one (interval, model) pair, and the task that builds their snapshots."""

    def __init__(self, hub: Source, interval_ms: int, model: str | None):
        self.hub, self.interval_ms, self.model = hub, interval_ms, model
        self.readers: set[Reader] = set()
        self.seq = 0
        self.since: dict[str, int] = {}  # per model: the last tick seq a snapshot carried
        self.latest: Snapshot | None = None
        self.task: asyncio.Task | None = None

    def build(self) -> Snapshot:
        self.seq += 1
        snap = self.hub.build(self.model, self.since)
        self.latest = Snapshot(self.seq, self.hub.clock(), snap)
        return self.latest

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        interval = self.interval_ms / 1000
        due = loop.time()
        while self.readers:
            due += interval
            await asyncio.sleep(max(0.0, due - loop.time()))
            if not self.readers:
                break
            if loop.time() - due > interval:  # the loop was blocked: start the schedule afresh
                due = loop.time()
            try:
                snap = self.build()
            except Exception:  # noqa: BLE001 - a model that went away mid-build, say: try again next time
                log.exception("events: building a snapshot failed")
            else:
                for reader in list(self.readers):
                    reader.offer(snap)
            self.hub.watch(self.readers, loop.time())
