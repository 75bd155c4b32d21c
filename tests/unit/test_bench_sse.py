"""tools/bench/client.py's SSE readers, which the load tool and the chaos scenarios judge streams
by: a stream that ended with ``[DONE]`` must be told from one cut short."""

from __future__ import annotations

import asyncio

from tools.bench.client import STREAM_DONE, sse_data, sse_events


async def _lines(*lines: bytes):
    for line in lines:
        yield line


def _events(*lines: bytes) -> list:
    async def collect():
        return [e async for e in sse_events(_lines(*lines))]
    return asyncio.run(collect())


def test_a_whole_stream_yields_its_objects_then_done():
    got = _events(b": ping\n", b'data: {"a": 1}\n', b"\n", b'data:{"b": 2}\r\n', b"data: [DONE]\n",
                  b'data: {"after": 1}\n')
    assert got == [{"a": 1}, {"b": 2}, STREAM_DONE]


def test_a_stream_cut_short_has_no_done():
    assert _events(b'data: {"a": 1}\n', b"data: {\"trunc") == [{"a": 1}]


def test_payloads_that_are_not_objects_are_skipped():
    assert _events(b"data: not json\n", b"data: [1, 2]\n", b'data: "x"\n', b"data: [DONE]\n") == [STREAM_DONE]


def test_sse_data_gives_the_raw_payloads_up_to_done():
    async def collect():
        return [p async for p in sse_data(_lines(b": ping\n", b"data: x\n", b"data:{}\n", b"data: [DONE]\n",
                                                 b"data: after\n"))]
    assert asyncio.run(collect()) == [b"x", b"{}"]
