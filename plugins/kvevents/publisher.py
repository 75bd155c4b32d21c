"""The publisher: takes each tick's cache events off the model's thread and sends them as
KV-event batches on a ZMQ PUB socket, from a thread of its own.

The tick hook only queues the tick's list of events (no copy, no hashing), so neither block
hashing nor a slow network ever delays a tick: the thread cuts and hashes blocks (``blocks.py``),
encodes (``wire.py``) and sends; ZMQ's own I/O thread carries the bytes, and a PUB socket drops
messages for a subscriber that falls more than the high-water mark behind, as vLLM's does.

Each model publishes on its own topic, a multipart message ``[topic, seq, payload]``: ``seq`` is
the topic's batch number (8 bytes, big-endian, from 0) and ``payload`` one ``KVEventBatch``. A
topic's first batch starts with ``AllBlocksCleared``: whatever an earlier run of this node
published under the same topic is gone."""

from __future__ import annotations

import logging
import queue
import threading
import time

import zmq

from superfluid.core.config import CORE_OPTIONS
from superfluid.core.errors import ConfigError
from superfluid.core.hookspecs import hookimpl

from .blocks import BlockLedger
from .endpoint import Endpoint, parse_endpoint, topic_for
from .options import OPTIONS
from .wire import AllBlocksCleared, encode_batch

log = logging.getLogger("superfluid.kvevents")

SNDHWM = 100_000     # batches a slow subscriber may fall behind before ZMQ drops (vLLM's default)
LINGER_MS = 1000     # on close, how long queued batches may still go out
_STOP = object()


class KVEventsPublisher:
    """One PUB socket for every model of the daemon. ``start()`` binds or connects it (a
    ConfigError if it cannot) and starts the thread; ``submit()`` is what the tick hook calls."""

    def __init__(self, endpoint: str, topic: str, block_size: int, encoding: str = "array",
                 host: str | None = None, port: int | None = None):
        self.endpoint: Endpoint = parse_endpoint(endpoint)
        self.topic_template = topic
        self.block_size = block_size
        self.encoding = encoding
        self.host, self.port = host, port
        self.sent = 0  # batches handed to ZMQ
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._ctx: zmq.Context | None = None
        self._sock: zmq.Socket | None = None
        self._thread: threading.Thread | None = None
        self._models: dict[str, tuple[bytes, BlockLedger, list[int]]] = {}  # topic, ledger, [next seq]

    def topic(self, model: str) -> str:
        return topic_for(self.topic_template, self.host, self.port, model)

    def start(self) -> None:
        self._ctx = zmq.Context()
        sock = self._ctx.socket(zmq.PUB)
        sock.setsockopt(zmq.SNDHWM, SNDHWM)
        sock.setsockopt(zmq.LINGER, LINGER_MS)
        if self.endpoint.ipv6:
            sock.setsockopt(zmq.IPV6, 1)
        try:
            (sock.bind if self.endpoint.bind else sock.connect)(self.endpoint.url)
        except zmq.ZMQError as exc:
            sock.close(0)
            self._ctx.term()
            self._ctx = None
            verb = "bind" if self.endpoint.bind else "connect to"
            raise ConfigError(f"--kv-events: cannot {verb} {self.endpoint.url}: {exc}") from None
        self._sock = sock  # from here on, only the publisher thread touches it
        self._thread = threading.Thread(target=self._run, name="superfluid-kv-events", daemon=True)
        self._thread.start()

    def submit(self, model: str, events: list) -> None:
        """Queue one tick's cache events (called on the model's thread: O(1))."""
        self._queue.put((model, time.time(), events))

    def close(self, timeout: float = 2.0) -> None:
        """Send what is queued, then close the socket (the thread closes it: it owns it)."""
        if self._thread is not None:
            self._queue.put(_STOP)
            self._thread.join(timeout)
            self._thread = None

    # ---- the publisher thread ---------------------------------------------------------------

    def _run(self) -> None:
        sock = self._sock
        try:
            while True:
                item = self._queue.get()
                if item is _STOP:
                    break
                try:
                    self._publish(sock, *item)
                except Exception:  # one bad batch must not end the stream
                    log.exception("kv events: could not publish a batch")
        finally:
            sock.close(LINGER_MS)
            self._sock = None
            ctx, self._ctx = self._ctx, None
            if ctx is not None:
                ctx.term()

    def _publish(self, sock: zmq.Socket, model: str, ts: float, events: list) -> None:
        state = self._models.get(model)
        first = state is None
        if first:
            state = self._models[model] = (self.topic(model).encode(), BlockLedger(model, self.block_size), [0])
        topic, ledger, seq = state
        wire = ledger.apply(events)
        if first and not (wire and isinstance(wire[0], AllBlocksCleared)):
            wire.insert(0, AllBlocksCleared())
        if not wire:
            return
        payload = encode_batch(ts, wire, self.encoding)
        sock.send_multipart([topic, seq[0].to_bytes(8, "big"), payload], copy=False)
        seq[0] += 1
        self.sent += 1


class KVEventsFrontend:
    """The publisher's life in the daemon: started with the front ends, it hears every tick
    (registered on the plugin manager while it runs) and stops with them."""

    def __init__(self, daemon, config):
        self.daemon = daemon
        own, core = OPTIONS.of(config), CORE_OPTIONS.of(config)
        self.publisher = KVEventsPublisher(own.kv_events, own.kv_events_topic, core.kv_events_block_size,
                                           own.kv_events_encoding, host=core.host, port=core.port)

    async def start(self) -> None:
        models = list(self.daemon.models)
        topics = {m: self.publisher.topic(m) for m in models}
        if len(set(topics.values())) < len(topics):
            raise ConfigError("--kv-events-topic: every model needs its own topic: put {model} in it "
                              f"(got {self.publisher.topic_template!r} for {', '.join(models)})")
        self.publisher.start()
        self.daemon.pm.register(self, name=f"superfluid.kvevents-{id(self)}")
        ep = self.publisher.endpoint
        log.info("kv events: %s %s, %s encoding, %d-token blocks, topic %s", "bound to" if ep.bind
                 else "connecting to", ep.url, self.publisher.encoding, self.publisher.block_size,
                 ", ".join(topics.values()) or self.publisher.topic("{model}"))

    async def stop(self) -> None:
        if self.daemon.pm.is_registered(self):
            self.daemon.pm.unregister(self)
        self.publisher.close()

    @hookimpl
    def superfluid_tick_done(self, model, stats):
        if stats.cache_events:
            self.publisher.submit(model, stats.cache_events)
