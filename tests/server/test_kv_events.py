"""KV events from a real server on the default model (``--kv-events``), heard by a real ZMQ SUB
socket bound on loopback, the way llm-d's indexer listens in its static-endpoint mode: a finished
request's full blocks are stored with exactly its prompt's token ids, a second request sharing
the prefix stores only its own blocks (chained on the shared ones), and a third, unrelated one
overwrites the older cache: the blocks only that cache held are removed from the KV pool, and
the whole cache is stored in the host tier ("CPU")."""

from __future__ import annotations

import msgpack
import pytest
import zmq

from ..unit.test_kv_events_wire import reference_chain
from .serverproc import free_port

BS = 16
# A request's events come from the tick that finished it and arrive within milliseconds of its
# answer (~15 ms on CI's machine), so a phase that another follows stops reading after this much
# quiet: an event later than that lands in the next phase's read, whose exact checks fail on it.
# The last phase waits out the full default quiet (0.5 s).
NEXT_PHASE_QUIET_S = 0.2


class Listener:
    """A SUB socket bound on a loopback port; batches as (topic, seq, decoded batch)."""

    def __init__(self):
        self.ctx = zmq.Context()
        self.port = free_port()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.bind(f"tcp://127.0.0.1:{self.port}")
        self.sub.setsockopt(zmq.SUBSCRIBE, b"kv@")

    def settle(self) -> None:
        """Let the socket take in the server's connection: ZMQ attaches a new peer (and sends it
        this socket's subscription) only while the socket is used, as an indexer's always is."""
        assert not self.sub.poll(500)  # nothing is published before a request

    def batches(self, first_s: float = 10.0, quiet_s: float = 0.5) -> list[tuple[bytes, int, list]]:
        """Everything that arrives until ``quiet_s`` passes with nothing new (waiting up to
        ``first_s`` for the first)."""
        out, wait = [], first_s
        while self.sub.poll(int(wait * 1000)):
            topic, seq, payload = self.sub.recv_multipart()
            out.append((topic, int.from_bytes(seq, "big"), msgpack.unpackb(payload, raw=False)))
            wait = quiet_s
        return out

    def close(self):
        self.ctx.destroy(linger=0)


@pytest.fixture
def listener():
    lis = Listener()
    yield lis
    lis.close()


def events_of(batches, tag: str) -> list[list]:
    return [e for _, _, b in batches for e in b[1] if e[0] == tag]


def complete(srv, ids: list[int]) -> dict:
    status, body = srv.call("POST", "/v1/completions", {"prompt": ids, "max_tokens": 1, "temperature": 0})
    assert status == 200, body
    assert body["usage"]["prompt_tokens"] == len(ids)
    return body


def test_blocks_follow_the_prefix_cache(start_server, listener):
    # (no OS pressure source: a shared CI machine's memory pressure would close the host tier)
    srv = start_server("--max-batch", "2", "--no-os-pressure", "--kv-events", f"tcp://127.0.0.1:{listener.port}")
    topic = f"kv@127.0.0.1:{srv.port}@smollm2".encode()
    listener.settle()
    text = " ".join(f"Item {i} of the inventory is a blue widget." for i in range(30))
    ids = srv.call("POST", "/tokenize", {"content": text})[1]["tokens"]
    assert len(ids) > 140
    P1 = ids[:100]
    ref1 = reference_chain("smollm2", P1)                    # 6 full blocks; 4 tokens left over

    complete(srv, P1)
    got = listener.batches(quiet_s=NEXT_PHASE_QUIET_S)
    assert got, "no KV events arrived"
    assert {t for t, _, _ in got} == {topic}
    assert [s for _, s, _ in got] == list(range(len(got)))   # the topic's batches, numbered from 0
    assert got[0][2][1][0] == ["AllBlocksCleared"]          # a new run: forget what an earlier one held
    stored = events_of(got, "BlockStored")
    assert [h for e in stored for h in e[1]] == ref1
    assert [t for e in stored for t in e[3]] == P1[:96]      # exactly the prompt's full blocks
    assert stored[0][2] is None and all(e[4] == BS and e[6] == "GPU" for e in stored)
    assert not events_of(got, "BlockRemoved")
    seq = got[-1][1]

    # Shares 80 tokens (5 blocks): only its own blocks are new, chained on the fifth shared one.
    P2 = P1[:80] + ids[100:140]
    ref2 = reference_chain("smollm2", P2)
    assert ref2[:5] == ref1[:5]
    complete(srv, P2)
    got = listener.batches(quiet_s=NEXT_PHASE_QUIET_S)
    assert [s for _, s, _ in got] == list(range(seq + 1, seq + 1 + len(got)))
    stored = events_of(got, "BlockStored")
    assert stored == [["BlockStored", ref2[5:7], ref1[4], P2[80:112], BS, None, "GPU", None]]
    assert not events_of(got, "BlockRemoved")                # P1's cache is still whole

    # Two unrelated prompts fill the two spare KV buffers (two lanes, four buffers): every slot
    # now holds a cached prefix.
    fillers = ([1000 + i for i in range(40)], [2000 + i for i in range(40)])
    for filler in fillers:
        complete(srv, filler)
    got = listener.batches(quiet_s=NEXT_PHASE_QUIET_S)
    assert not events_of(got, "BlockRemoved")
    # and only their own blocks are stored (nothing late from P2's request)
    assert [h for e in events_of(got, "BlockStored") for h in e[1]] == \
        [h for f in fillers for h in reference_chain("smollm2", f)]

    # Unrelated: it overwrites the oldest cache (P1's): only P1's own sixth block leaves the pool,
    # the five it shares with P2's cache stay; P1 goes to the host tier, stored there whole.
    P3 = list(reversed(ids[:48]))
    complete(srv, P3)
    got = listener.batches()
    removed_gpu = [h for e in events_of(got, "BlockRemoved") if e[2] == "GPU" for h in e[1]]
    assert removed_gpu == [ref1[5]]
    stored = events_of(got, "BlockStored")
    gpu = [e for e in stored if e[6] == "GPU"]
    assert [h for e in gpu for h in e[1]] == reference_chain("smollm2", P3)
    cpu = [e for e in stored if e[6] == "CPU"]
    assert cpu == [["BlockStored", ref1, None, P1[:96], BS, None, "CPU", None]]   # parked in host memory
