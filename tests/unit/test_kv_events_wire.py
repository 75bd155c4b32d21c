"""KV events on the wire (plugins/kvevents): the exact msgpack layout of vLLM's KVEventBatch, the
chained block hashes against a reference computed here, the per-medium block ledger (full blocks
only, each published once, removed with its last holder), and the publisher on real ZMQ sockets:
multipart [topic, seq, payload] read by a real SUB socket, in both connect and bind modes.

vLLM's layout (vllm/distributed/kv_events.py, msgspec ``array_like=True, omit_defaults=True,
tag=True`` before its PR #42892): a batch is [ts, events, data_parallel_rank]; BlockStored is
[tag, block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, lora_name];
BlockRemoved [tag, block_hashes, medium]; AllBlocksCleared [tag]. llm-d-kv-cache's VLLMAdapter
reads exactly these positions (pkg/kvevents/engineadapter/vllm_adapter.go)."""

from __future__ import annotations

import hashlib
import socket
import struct
import time

import msgpack
import pytest
import zmq

from superfluid.core.cli import load
from superfluid.core.errors import ConfigError
from superfluid.core.cache_events import CacheEvent
from superfluid.core.block_hash import block_hashes, chain_hash, root_hash
from superfluid.plugins.kvevents.blocks import BlockLedger
from superfluid.plugins.kvevents.endpoint import parse_endpoint
from superfluid.plugins.kvevents.publisher import KVEventsPublisher
from superfluid.plugins.kvevents.wire import AllBlocksCleared, BlockRemoved, BlockStored, encode_batch

BS = 16


def reference_chain(model: str, tokens: list[int], block_size: int = BS) -> list[int]:
    """The documented hash, computed independently: BLAKE2b-64 over the parent (8 bytes
    big-endian) and the block's ids (little-endian int64), chained from BLAKE2b-64 of
    "superfluid-kv:<model>:<block size>"."""
    parent = int.from_bytes(hashlib.blake2b(f"superfluid-kv:{model}:{block_size}".encode(),
                                            digest_size=8).digest(), "big")
    out = []
    for i in range(len(tokens) // block_size):
        block = tokens[i * block_size:(i + 1) * block_size]
        digest = hashlib.blake2b(parent.to_bytes(8, "big") + struct.pack(f"<{block_size}q", *block),
                                 digest_size=8).digest()
        parent = int.from_bytes(digest, "big") or 1
        out.append(parent)
    return out


def stored(holder, tokens, medium="gpu"):
    return CacheEvent("stored", medium, holder, tokens, len(tokens))


# ---- layout ---------------------------------------------------------------------------------------

def test_array_layout_is_vllms():
    big = (1 << 64) - 5
    events = [BlockStored([big, 7], None, list(range(32)), 16, "GPU"), BlockStored([9], 7, list(range(16)), 16, "CPU"),
              BlockRemoved([big], "GPU"), AllBlocksCleared()]
    decoded = msgpack.unpackb(encode_batch(1234.5, events), raw=False)
    assert decoded == [1234.5, [
        ["BlockStored", [big, 7], None, list(range(32)), 16, None, "GPU", None],
        ["BlockStored", [9], 7, list(range(16)), 16, None, "CPU", None],
        ["BlockRemoved", [big], "GPU"],
        ["AllBlocksCleared"]], 0]
    assert isinstance(decoded[0], float)


def test_map_layout_is_vllms_since_its_map_encoding():
    events = [BlockStored([5, 6], 4, list(range(32)), 16, "GPU"), BlockRemoved([6], "CPU"), AllBlocksCleared()]
    decoded = msgpack.unpackb(encode_batch(1.0, events, "map"), raw=False)
    assert decoded[0] == 1.0 and decoded[2] == 0
    assert decoded[1] == [
        {"type": "BlockStored", "block_hashes": [5, 6], "parent_block_hash": 4, "token_ids": list(range(32)),
         "block_size": 16, "lora_id": None, "medium": "GPU", "lora_name": None},
        {"type": "BlockRemoved", "block_hashes": [6], "medium": "CPU"},
        {"type": "AllBlocksCleared"}]
    assert list(decoded[1][0]) == ["type", "block_hashes", "parent_block_hash", "token_ids", "block_size",
                                   "lora_id", "medium", "lora_name"]


# ---- hashes ---------------------------------------------------------------------------------------

def test_chained_hashes_match_the_reference():
    tokens = [(i * 7919) % 49152 for i in range(16 * 6 + 5)]
    chain = block_hashes(root_hash("smollm2", BS), tokens, BS)
    assert chain == reference_chain("smollm2", tokens)
    assert len(chain) == 6 and len(set(chain)) == 6 and all(0 < h < 1 << 64 for h in chain)
    # a block's hash names everything before it: one token changed early changes every later hash
    changed = block_hashes(root_hash("smollm2", BS), [tokens[0] + 1] + tokens[1:], BS)
    assert not set(changed) & set(chain)
    # a prefix's chain is a prefix of the chain; another model or block size names other blocks
    assert block_hashes(root_hash("smollm2", BS), tokens[:48], BS) == chain[:3]
    assert not set(block_hashes(root_hash("other", BS), tokens, BS)) & set(chain)
    assert block_hashes(root_hash("smollm2", 8), tokens, 8)[1] != chain[0]
    # one block at a time (as basert's pool names its pages) is the same chain
    parent, stepped = root_hash("smollm2", BS), []
    for i in range(6):
        parent = chain_hash(parent, tokens[i * BS:(i + 1) * BS])
        stepped.append(parent)
    assert stepped == chain


# ---- the ledger -----------------------------------------------------------------------------------

def test_full_blocks_only_each_published_once_removed_with_the_last_holder():
    ledger = BlockLedger("m", BS)
    A = list(range(1000, 1000 + 16 * 5 + 3))               # 5 full blocks and 3 tokens
    ref = reference_chain("m", A)
    out = ledger.apply([stored(0, A)])
    assert out == [BlockStored(ref, None, A[:80], BS, "GPU")]
    assert ledger.apply([stored(0, A[:10])]) == [BlockRemoved(ref[::-1], "GPU")]   # cut below one block
    ledger.apply([stored(0, A)])
    B = A[:48] + list(range(5000, 5040))                    # shares 3 blocks, then 2 of its own (+8)
    ref_b = reference_chain("m", B)
    out = ledger.apply([stored(1, B)])
    assert out == [BlockStored(ref_b[3:5], ref[2], B[48:80], BS, "GPU")]            # only the new blocks
    assert ledger.apply([stored(2, A[:64])]) == []                                # all held already
    out = ledger.apply([CacheEvent("removed", "gpu", 0)])
    assert out == [BlockRemoved([ref[4]], "GPU")]            # block 4 was A's alone; 3 is slot 2's too
    out = ledger.apply([CacheEvent("removed", "gpu", 2), CacheEvent("removed", "gpu", 1)])
    assert out == [BlockRemoved([ref[3]], "GPU"), BlockRemoved([ref_b[4], ref_b[3], ref[2], ref[1], ref[0]], "GPU")]
    assert ledger.blocks("gpu") == set()


def test_media_are_counted_apart_and_cleared_apart():
    ledger = BlockLedger("m", BS)
    A = list(range(64))
    ref = reference_chain("m", A)
    out = ledger.apply([stored(0, A), stored("prefix-1", A, "cpu")])
    assert out == [BlockStored(ref, None, A, BS, "GPU"), BlockStored(ref, None, A, BS, "CPU")]
    assert ledger.apply([CacheEvent("cleared", "cpu")]) == [BlockRemoved(ref, "CPU")]
    assert ledger.blocks("gpu") == set(ref) and ledger.blocks("cpu") == set()
    # everything cleared: one AllBlocksCleared, and what came before it in the batch is moot
    out = ledger.apply([stored(1, list(range(100, 164))), CacheEvent("cleared", None), stored(2, A)])
    assert out == [AllBlocksCleared(), BlockStored(ref, None, A, BS, "GPU")]
    assert ledger.apply([CacheEvent("removed", "gpu", 0)]) == []                 # forgotten by the clear


# ---- endpoints and options ------------------------------------------------------------------------

@pytest.mark.parametrize("text,bind", [("tcp://*:5557", True), ("tcp://0.0.0.0:5557", True),
                                       ("tcp://[::]:5557", True), ("ipc:///tmp/kv.sock", True),
                                       ("tcp://indexer.svc:5557", False), ("tcp://10.0.0.7:5557", False)])
def test_endpoints_bind_on_a_wildcard_and_connect_otherwise(text, bind):
    assert parse_endpoint(text).bind is bind


@pytest.mark.parametrize("bad", ["5557", "tcp://host", "tcp://host:0", "tcp://host:70000", "udp://h:1",
                                 "tcp://[zz]:5557", "ipc://", "tcp://a b:1"])
def test_a_bad_endpoint_is_a_config_error_naming_the_option(bad):
    with pytest.raises(ConfigError, match="kv-events.*ZMQ endpoint|kv-events.*port|kv-events.*IPv6|kv-events.*path"):
        load(["serve", "--kv-events", bad])


def test_options_default_off_and_checked():
    config, _ = load(["serve"])
    assert config["kv-events"] == "" and config["kv-events-block-size"] == 16
    assert config["kv-events-topic"] == "kv@{host}:{port}@{model}" and config["kv-events-encoding"] == "array"
    with pytest.raises(ConfigError, match="kv-events-topic"):
        load(["serve", "--kv-events", "tcp://*:5557", "--kv-events-topic", "kv@{pod}@{model}"])
    with pytest.raises(ConfigError, match="kv-events-encoding"):
        load(["serve", "--kv-events-encoding", "json"])
    with pytest.raises(ConfigError, match="kv-events-block-size"):
        load(["serve", "--kv-events-block-size", "0"])


# ---- the publisher on real sockets ----------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def receive(sub: zmq.Socket, timeout_s: float = 5.0) -> list[bytes] | None:
    if sub.poll(int(timeout_s * 1000)):
        return sub.recv_multipart()
    return None


def connected(pub: KVEventsPublisher, sub: zmq.Socket, model: str) -> list[bytes]:
    """Send clears until the SUB hears one (a PUB drops what it sends before the subscription
    reaches it); the first frames heard."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        pub.submit(model, [CacheEvent("cleared", None)])
        frames = receive(sub, 0.1)
        if frames is not None:
            return frames
    raise AssertionError("the SUB socket never heard the publisher")


@pytest.fixture
def zctx():
    ctx = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


def test_publisher_connects_to_a_bound_sub_and_sends_vllm_frames(zctx):
    port = free_port()
    sub = zctx.socket(zmq.SUB)
    sub.bind(f"tcp://127.0.0.1:{port}")
    sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
    pub = KVEventsPublisher(f"tcp://127.0.0.1:{port}", "kv@{host}:{port}@{model}", BS, host="10.1.2.3", port=8000)
    pub.start()
    try:
        topic, seq, payload = connected(pub, sub, "smollm2")
        assert topic == b"kv@10.1.2.3:8000@smollm2" and len(seq) == 8
        first = int.from_bytes(seq, "big")
        assert msgpack.unpackb(payload)[1][0] == ["AllBlocksCleared"]
        A = list(range(200, 240))
        pub.submit("smollm2", [stored(3, A)])
        pub.submit("smollm2", [CacheEvent("removed", "gpu", 3)])
        frames = [receive(sub), receive(sub)]
        assert [f[0] for f in frames] == [topic, topic]
        assert [int.from_bytes(f[1], "big") for f in frames] == [first + 1, first + 2]
        batches = [msgpack.unpackb(f[2], raw=False) for f in frames]
        ref = reference_chain("smollm2", A)
        assert batches[0][1] == [["BlockStored", ref, None, A[:32], BS, None, "GPU", None]]
        assert batches[1][1] == [["BlockRemoved", ref[::-1], "GPU"]]
        assert all(isinstance(b[0], float) and abs(b[0] - time.time()) < 60 and b[2] == 0 for b in batches)
        assert receive(sub, 0.2) is None                  # a partial block alone publishes nothing
        pub.submit("smollm2", [stored(4, A[:15])])
        assert receive(sub, 0.3) is None
    finally:
        pub.close()


def test_publisher_binds_and_each_model_has_its_topic(zctx, tmp_path):
    endpoint = f"ipc://{tmp_path}/kv.sock"
    pub = KVEventsPublisher(endpoint, "kv@{host}:{port}@{model}", BS, encoding="map", host="127.0.0.1", port=9)
    pub.start()
    sub = zctx.socket(zmq.SUB)
    sub.connect(endpoint)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    try:
        connected(pub, sub, "a")
        pub.submit("b", [stored(0, list(range(16)))])
        topic, seq, payload = receive(sub)
        while topic == b"kv@127.0.0.1:9@a":               # clears still in flight for model a
            topic, seq, payload = receive(sub)
        assert topic == b"kv@127.0.0.1:9@b" and int.from_bytes(seq, "big") == 0    # b's own numbering
        events = msgpack.unpackb(payload, raw=False)[1]
        assert [e["type"] for e in events] == ["AllBlocksCleared", "BlockStored"]   # b's first batch
        assert events[1]["token_ids"] == list(range(16)) and events[1]["block_hashes"] == reference_chain("b", list(range(16)))
    finally:
        pub.close()


def test_a_socket_that_cannot_bind_is_a_config_error(tmp_path):
    pub = KVEventsPublisher(f"ipc://{tmp_path}/missing/dir/kv.sock", "kv@{host}:{port}@{model}", BS)
    with pytest.raises(ConfigError, match="--kv-events: cannot bind"):
        pub.start()


# ---- the publisher in the daemon ------------------------------------------------------------------

def daemon_with(models: list[str]):
    """A daemon as the front end sees it: its models, and a plugin manager with no other plugin."""
    from types import SimpleNamespace

    import pluggy

    from superfluid.core import hookspecs
    pm = pluggy.PluginManager("superfluid")
    pm.add_hookspecs(hookspecs)
    return SimpleNamespace(models={m: None for m in models}, pm=pm)


def kv_config(endpoint: str, *flags: str):
    config, _ = load(["serve", "--kv-events", endpoint, *flags])
    return config


def test_the_frontend_hears_ticks_while_it_runs(zctx, tmp_path):
    import asyncio
    from types import SimpleNamespace

    from superfluid.plugins.kvevents.publisher import KVEventsFrontend
    endpoint = f"ipc://{tmp_path}/kv.sock"
    daemon = daemon_with(["m"])
    fe = KVEventsFrontend(daemon, kv_config(endpoint, "--kv-events-block-size", "8"))
    asyncio.run(fe.start())
    sub = zctx.socket(zmq.SUB)
    sub.connect(endpoint)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    try:
        assert daemon.pm.is_registered(fe)
        deadline, frames, n = time.monotonic() + 10, None, 0
        while frames is None and time.monotonic() < deadline:   # through the tick hook, as the loop calls it
            tokens = list(range(8 * n, 8 * n + 8))                # a new block each time: something to send
            n += 1
            daemon.pm.hook.superfluid_tick_done(model="m", stats=SimpleNamespace(cache_events=[stored(n, tokens)]))
            frames = receive(sub, 0.1)
        assert frames is not None
        batch = msgpack.unpackb(frames[2], raw=False)
        assert batch[1][-1][0] == "BlockStored" and batch[1][-1][4] == 8
    finally:
        asyncio.run(fe.stop())
    assert not daemon.pm.is_registered(fe)


def test_two_models_on_one_topic_is_a_config_error():
    import asyncio

    from superfluid.plugins.kvevents.publisher import KVEventsFrontend
    fe = KVEventsFrontend(daemon_with(["a", "b"]), kv_config("tcp://127.0.0.1:1", "--kv-events-topic", "kv@{host}:{port}@x"))
    with pytest.raises(ConfigError, match="every model needs its own topic"):
        asyncio.run(fe.start())
