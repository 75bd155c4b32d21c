"""A chat stream keeps flowing while a long prompt arrives beside it, on the real server.

While a client reads a stream, the planner holds each tick's prefill to what the busy tick target
holds, in one engine step (plugins/qos/planner.stream_step). Before, a newcomer's prompt went in
512-token steps: about 2 s each on 2 cores, and the stream received one delta per step. Counted
here, not timed: the deltas a stream receives while a long prompt prefills, against the number of
512-token steps the prompt takes. Then the tick a stream about to end takes for its last rounds
before an agent's long prefill goes on, read from the ticks /events reports. Also the bench tool
that measures the gaps (tools/bench/stream_gaps.py), run small against the same server."""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import pytest

from tools.bench import stream_gaps
from tools.bench.agents_chat import agent_prompt
from tools.bench.client import sse_data, sse_events

OLD_STEP = 512  # llama.cpp's micro-batch: what one tick prefilled before, with every lane busy


@pytest.fixture(scope="module")
def full(start_server):
    """Two lanes: the stream and the newcomer fill them, so the planner's busy caps apply (with a
    lane free it held prefill ticks to half a second already)."""
    return start_server("--max-batch", "2", shared=True)


async def _read_chat_stream(http, base: str, text: str, max_tokens: int, deltas: list[float],
                            started: asyncio.Event, clock) -> None:
    """One greedy chat stream read to its end: ``clock()`` appended to ``deltas`` at each content
    delta, ``started`` set at the first."""
    body = {"model": "smollm2", "messages": [{"role": "user", "content": text}],
            "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0, "stream": True}
    async with http.post(base + "/v1/chat/completions", json=body) as r:
        assert r.status == 200, await r.text()
        async for payload in sse_data(r.content):
            if any((c.get("delta") or {}).get("content") for c in json.loads(payload).get("choices") or ()):
                deltas.append(clock())
                started.set()


async def _long_prompt(http, base: str, seed: int, clock, headers=None) -> tuple[float, float | None, int]:
    """A 1,500-token prompt streamed for one token: (its send instant, its first token's, its
    prompt tokens), on ``clock``."""
    body = {"model": "smollm2", "prompt": agent_prompt(seed, 1500), "max_tokens": 1, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    sent, first, prompt_tokens = clock(), None, 0
    async with http.post(base + "/v1/completions", json=body, headers=headers) as r:
        assert r.status == 200, await r.text()
        async for payload in sse_data(r.content):
            chunk = json.loads(payload)
            if first is None and any(c.get("text") for c in chunk.get("choices") or ()):
                first = clock()
            prompt_tokens = (chunk.get("usage") or {}).get("prompt_tokens") or prompt_tokens
    return sent, first, prompt_tokens


async def _deltas_during_a_long_prefill(base: str) -> tuple[list[float], float, float, int]:
    """(the stream's delta instants, the arrival's send and first-token instants, its prompt tokens)."""
    async with aiohttp.ClientSession() as http:
        started = asyncio.Event()
        deltas: list[float] = []
        reader = asyncio.create_task(_read_chat_stream(http, base, "Tell a long story.", 400, deltas, started,
                                                       time.perf_counter))
        await asyncio.wait_for(started.wait(), 120)
        sent, first, prompt_tokens = await _long_prompt(http, base, 1, time.perf_counter)
        reader.cancel()
        return deltas, sent, first, prompt_tokens


def test_a_stream_keeps_receiving_while_a_long_prompt_prefills(full):
    deltas, sent, first, prompt_tokens = asyncio.run(_deltas_during_a_long_prefill(full.base))
    assert first is not None and prompt_tokens > 1200
    during = sum(sent < t < first for t in deltas)
    old_steps = -(-prompt_tokens // OLD_STEP)  # 3 steps for ~1500 tokens: about one delta each
    assert during >= 2 * old_steps, (during, old_steps, prompt_tokens, round(first - sent, 2))


def test_the_stream_gaps_tool_measures_every_stream_and_arrival(full, tmp_path, capsys):
    out = tmp_path / "gaps.json"
    assert stream_gaps.main(["--target", f"sf={full.base}", "--streams", "1", "--stream-tokens", "24",
                             "--arrivals", "1", "--arrival-tokens", "300", "--rounds", "1", "--warmup", "0",
                             "--token-events", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    run = doc["runs"]["sf"]["1"][0]
    assert len(run["streams"]) == 1 and all(s["completion_tokens"] == 24 for s in run["streams"])
    assert all(len(s["gaps_s"]) == s["deltas"] - 1 >= 1 for s in run["streams"])
    # logprobs come with every token, so every content delta is also a token event
    assert all(s["deltas"] <= s["token_events"] <= 24 for s in run["streams"])
    assert run["arrivals"][0]["ttft_s"] > 0 and run["arrivals"][0]["prompt_tokens"] > 200
    gaps = doc["summary"]["sf"]["1"]["gaps"]
    assert 0 < gaps["p50"] <= gaps["p99"] <= gaps["max"] and gaps["streams"] == 1
    assert "| sf | 1 |" in capsys.readouterr().out


async def _recent_ticks(base: str) -> list[dict]:
    """The model's recent ticks, from the first snapshot of GET /events (its last 200 ticks; the
    hello event before it names the models in a list)."""
    async with aiohttp.ClientSession() as http, http.get(base + "/events") as r:
        async for event in sse_events(r.content):
            if isinstance(event, dict) and isinstance(event.get("models"), dict):
                return event["models"]["smollm2"]["ticks"]
    raise AssertionError("/events sent no snapshot")


async def _stream_then_agent_prompt(base: str) -> tuple[float, float, float]:
    """A short chat stream, and an agent's long prompt sent at its first delta: (the prompt's send
    instant, the stream's last delta, the prompt's first token), wall-clock seconds as the ticks'."""
    async with aiohttp.ClientSession() as http:
        started = asyncio.Event()
        deltas: list[float] = []
        reader = asyncio.create_task(_read_chat_stream(http, base, "Describe the sea.", 24, deltas, started,
                                                       time.time))
        await asyncio.wait_for(started.wait(), 120)
        sent, first, _ = await _long_prompt(http, base, 7, time.time, headers={"x-superfluid-qos": "agent"})
        await reader
        return sent, deltas[-1], first


def test_a_stream_about_to_end_takes_its_last_rounds_before_an_agents_prefill(full):
    """The planner's finishing tick (plugins/qos/planner.finishing_rounds) on the real engine: the
    stream's last rounds run in one tick with no prefill, then the agent's prompt goes on in full
    steps. Without it, every tick after the admission holds a small prefill step and one round,
    until the stream ends. Ticks from /events: those that started after the prompt was sent."""
    sent, stream_end, first = asyncio.run(_stream_then_agent_prompt(full.base))
    assert first is not None and stream_end < first
    ticks = [t for t in asyncio.run(_recent_ticks(full.base)) if t["at"] - t["seconds"] >= sent and t["at"] <= first]
    finishing = [t for t in ticks if t["prefill_tokens"] == 0 and t["decode_tokens"] >= 8]
    assert finishing, [(t["prefill_tokens"], t["decode_tokens"]) for t in ticks]
    # the prefill went on after it, in steps the stream no longer held small
    assert any(t["prefill_tokens"] > 0 and t["at"] > finishing[0]["at"] for t in ticks)
