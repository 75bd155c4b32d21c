"""The bench tool's method: throughput arithmetic, median of measured rounds, and the
round-by-round interleaving of targets, checked against a fake OpenAI server."""

from __future__ import annotations

import asyncio
import json
import statistics

import pytest
from aiohttp import web

from tools.bench import method, prompts, report
from tools.bench.runner import Results, Settings, Target, ThroughputRound, run

FAKE_TOKENS = 16  # the fake's usage.completion_tokens, fixed
FAKE_DELAY = 0.1  # seconds the fake takes to answer a completion
FAKE_TTFT = 0.1  # seconds before the fake's first content delta
FAKE_GAP = 0.03  # seconds between the fake's content deltas
FAKE_DELTAS = 3  # content deltas per fake stream (then a usage chunk of 2 tokens per delta)
TEST_DEADLINE = 60.0


class FakeOpenAI:
    """A stand-in OpenAI server with one route tree per prefix (one per target).

    It logs each request in arrival order and tracks how many are in flight."""

    def __init__(self, prefixes: list[str]):
        self.log: list[dict] = []
        self.inflight = 0
        self.max_inflight_seen: list[int] = []
        self.app = web.Application()
        for p in prefixes:
            self.app.router.add_get(f"/{p}/v1/models", self._models(p))
            self.app.router.add_post(f"/{p}/v1/completions", self._completions(p))
            self.app.router.add_post(f"/{p}/v1/chat/completions", self._chat(p))
        self.runner: web.AppRunner | None = None
        self.port = 0

    async def start(self) -> None:
        self.runner = web.AppRunner(self.app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.port = self.runner.addresses[0][1]

    async def stop(self) -> None:
        if self.runner:
            await self.runner.cleanup()

    def base(self, prefix: str) -> str:
        return f"http://127.0.0.1:{self.port}/{prefix}"

    def _models(self, p):
        async def handler(_req):
            return web.json_response({"object": "list", "data": [{"id": f"fake-{p}"}]})
        return handler

    def _enter(self, kind: str, p: str, body: dict) -> None:
        self.inflight += 1
        self.log.append({"kind": kind, "target": p, "body": body, "inflight": self.inflight})

    def _completions(self, p):
        async def handler(req):
            body = await req.json()
            self._enter("completion", p, body)
            try:
                await asyncio.sleep(FAKE_DELAY)
            finally:
                self.inflight -= 1
            return web.json_response({
                "object": "text_completion", "model": body["model"],
                "choices": [{"index": 0, "text": "x", "finish_reason": "length"}],
                "usage": {"prompt_tokens": 9, "completion_tokens": FAKE_TOKENS,
                          "total_tokens": 9 + FAKE_TOKENS},
            })
        return handler

    def _chat(self, p):
        async def handler(req):
            body = await req.json()
            self._enter("chat", p, body)
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(req)

            async def send(delta):
                chunk = {"object": "chat.completion.chunk",
                         "choices": [{"index": 0, "delta": delta}]}
                await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")

            try:
                await send({"role": "assistant"})  # no content: must not count as first token
                await asyncio.sleep(FAKE_TTFT)
                for i in range(FAKE_DELTAS):
                    if i:
                        await asyncio.sleep(FAKE_GAP)
                    await send({"content": "tok"})
                usage = {"prompt_tokens": 9, "completion_tokens": 2 * FAKE_DELTAS}
                await resp.write(b"data: " + json.dumps({"choices": [], "usage": usage}).encode() + b"\n\n")
                await resp.write(b"data: [DONE]\n\n")
            finally:
                self.inflight -= 1
            return resp
        return handler


# ---- pure arithmetic -------------------------------------------------------------------

def test_throughput_is_tokens_over_first_send_to_last_response():
    assert method.throughput([256, 256, 256, 256], 10.0, 14.0) == 256.0
    assert method.throughput([3, 4, 5], 1.5, 3.5) == 6.0
    with pytest.raises(ValueError):
        method.throughput([1], 2.0, 2.0)


def test_median_of_measured_rounds_discards_warmup():
    s = Settings(concurrencies=[4], rounds=3, warmup=1)
    res = Results(targets=[Target("a", "http://x")], settings=s)
    for rnd, (tok_s, warm) in enumerate([(1000.0, True), (10.0, False), (30.0, False), (20.0, False)]):
        res.throughput_rounds.append(ThroughputRound(
            target="a", concurrency=4, round=rnd, warmup=warm,
            completion_tokens=[1], wall_s=1.0, tok_s=tok_s, short=0))
    assert res.throughput_cell("a", 4) == 20.0  # median of 10, 30, 20; warm-up 1000 ignored
    assert res.throughput_cell("a", 8) is None
    assert method.median([1.0, 2.0, 3.0, 10.0]) == 2.5


def test_schedule_interleaves_targets_round_by_round():
    steps = list(method.schedule(["A", "B"], [1, 2], rounds=2, warmup=1))
    got = [(s.concurrency, s.round, s.target, s.warmup) for s in steps]
    assert got == [
        (1, 0, "A", True), (1, 0, "B", True),
        (1, 1, "A", False), (1, 1, "B", False),
        (1, 2, "A", False), (1, 2, "B", False),
        (2, 0, "A", True), (2, 0, "B", True),
        (2, 1, "A", False), (2, 1, "B", False),
        (2, 2, "A", False), (2, 2, "B", False),
    ]


def test_prompts_are_distinct_chatml_and_shared_across_targets():
    batch = prompts.completion_prompts(20, "t8r1")
    assert len(set(batch)) == 20
    assert all(p.startswith("<|im_start|>user\n[t8r1.") for p in batch)
    assert all(p.endswith("<|im_end|>\n<|im_start|>assistant\n") for p in batch)
    assert len(prompts.PROMPTS) >= 8
    assert prompts.completion_prompts(3, "x") == prompts.completion_prompts(3, "x")


def test_parse_target_and_concurrency():
    assert method.parse_target("sf=http://h:1/") == ("sf", "http://h:1")
    assert method.parse_target("ls=http://h:2/v1") == ("ls", "http://h:2")
    assert method.parse_concurrencies("1, 2,4,8") == [1, 2, 4, 8]
    for bad in ("x", "=http://h"):
        with pytest.raises(ValueError):
            method.parse_target(bad)
    with pytest.raises(ValueError):
        method.parse_concurrencies("0")


# ---- against the fake server --------------------------------------------------------

def _run_against_fake(settings: Settings) -> tuple[Results, FakeOpenAI]:
    async def go():
        fake = FakeOpenAI(["a", "b"])
        await fake.start()
        try:
            targets = [Target("A", fake.base("a")), Target("B", fake.base("b"))]
            res = await asyncio.wait_for(run(targets, settings, progress=lambda _l: None),
                                         TEST_DEADLINE)
        finally:
            await fake.stop()
        return res, fake
    return asyncio.run(go())


def _blocks(log: list[dict], kind: str, concurrencies: list[int], per_c: int) -> list[list[dict]]:
    """Split the fake's arrival log into rounds: per_c rounds of c requests at each c."""
    entries = [e for e in log if e["kind"] == kind]
    out, i = [], 0
    for c in concurrencies:
        for _ in range(per_c):
            out.append(entries[i:i + c])
            i += c
    assert i == len(entries)
    return out


def test_bench_against_fake_server():
    cs = [1, 3]
    s = Settings(concurrencies=cs, rounds=3, warmup=1, max_tokens=FAKE_TOKENS,
                 ttft_max_tokens=4, request_timeout=10.0, connect_timeout=5.0)
    res, fake = _run_against_fake(s)
    assert res.error is None
    assert [t.model for t in res.targets] == ["fake-a", "fake-b"]

    # Rounds ran in the interleaved order, warm-up first at each concurrency.
    expected = [(st.concurrency, st.round, st.target, st.warmup)
                for st in method.schedule(["A", "B"], cs, 3, 1)]
    assert [(r.concurrency, r.round, r.target, r.warmup) for r in res.throughput_rounds] == expected
    assert [(r.concurrency, r.round, r.target, r.warmup) for r in res.ttft_rounds] == expected

    # The server saw the same thing: each round is c concurrent requests to one target,
    # with c distinct prompts, alternating A, B, A, B ...
    for kind in ("completion", "chat"):
        blocks = _blocks(fake.log, kind, cs, per_c=2 * 4)
        for n, block in enumerate(blocks):
            assert {e["target"] for e in block} == {"ab"[n % 2]}
            assert max(e["inflight"] for e in block) == len(block)  # all in flight at once
            texts = [e["body"].get("prompt") or e["body"]["messages"][0]["content"] for e in block]
            assert len(set(texts)) == len(block)
            for e in block:
                assert e["body"]["model"] == f"fake-{e['target']}"
                assert e["body"]["ignore_eos"] is True
                assert e["body"]["temperature"] == 0.0
        # Both targets got identical prompts for the same round.
        for a_block, b_block in zip(blocks[0::2], blocks[1::2]):
            key = "prompt" if kind == "completion" else "messages"
            assert [e["body"][key] for e in a_block] == [e["body"][key] for e in b_block]
    completions = [e for e in fake.log if e["kind"] == "completion"]
    assert all(e["body"]["prompt"].startswith("<|im_start|>user\n") for e in completions)
    assert all(e["body"]["stream"] is True for e in fake.log if e["kind"] == "chat")

    # Throughput arithmetic: summed usage over first send .. last response.
    for r in res.throughput_rounds:
        assert r.completion_tokens == [FAKE_TOKENS] * r.concurrency
        assert r.short == 0
        assert FAKE_DELAY <= r.wall_s < 5.0
        assert r.tok_s == pytest.approx(FAKE_TOKENS * r.concurrency / r.wall_s)
    for name in ("A", "B"):
        for c in cs:
            measured = [r.tok_s for r in res.throughput_rounds
                        if r.target == name and r.concurrency == c and not r.warmup]
            assert len(measured) == 3
            assert res.throughput_cell(name, c) == statistics.median(measured)

    # TTFT: the role-only chunk does not count; the first content delta does.
    for r in res.ttft_rounds:
        assert len(r.ttft_s) == r.concurrency
        assert all(t is not None and FAKE_TTFT <= t < 5.0 for t in r.ttft_s)

    # Smoothness: every stream's gaps between its content deltas (not the role chunk, not
    # the usage chunk), and the usage's tokens beside the delta count.
    for r in res.ttft_rounds:
        assert r.deltas == [FAKE_DELTAS] * r.concurrency
        assert r.completion_tokens == [2 * FAKE_DELTAS] * r.concurrency
        assert [len(g) for g in r.gaps_s] == [FAKE_DELTAS - 1] * r.concurrency
        # The fake sleeps FAKE_GAP between deltas. A delta read late (a busy machine) shortens the
        # gap after it, so the bound on each gap is loose: a usage or [DONE] chunk counted as a
        # delta would come within a millisecond of the last one. Their median is the fake's gap.
        all_gaps = [g for gs in r.gaps_s for g in gs]
        assert all(FAKE_GAP * 0.25 <= g < 2.0 for g in all_gaps)
        assert statistics.median(all_gaps) >= FAKE_GAP * 0.9
        assert all(e["body"]["stream_options"] == {"include_usage": True}
                   for e in fake.log if e["kind"] == "chat")
    for name in ("A", "B"):
        for c in cs:
            cell = res.smoothness_cell(name, c)
            assert cell.streams == 3 * c and cell.gaps == 3 * c * (FAKE_DELTAS - 1)
            assert FAKE_GAP * 0.9 <= cell.p50 <= cell.p99 <= cell.max < 2.0
            assert res.tokens_per_delta(name, c) == 2.0

    md = report.markdown(res)
    assert "| A p50 |" in md and "| B worst stream's p99 |" in md and "| A tokens per delta | 2.00 |" in md
    assert "| A / B |" in md and "| target | 1 | 3 |" in md
    data = res.to_json()
    assert set(data["throughput_tok_s"]) == {"A", "B"}
    assert set(data["smoothness_s"]["A"]["3"]) == {"p50", "p99", "max", "worst_stream_p99", "gaps", "streams"}
    json.dumps(data)


def test_sampled_settings_reach_the_server():
    s = Settings(concurrencies=[2], rounds=1, warmup=0, max_tokens=FAKE_TOKENS, sampled=True,
                 ttft=False, request_timeout=10.0, connect_timeout=5.0)
    res, fake = _run_against_fake(s)
    assert res.error is None
    bodies = [e["body"] for e in fake.log]
    assert len(bodies) == 4  # one round of two requests per target
    for b in bodies:
        assert (b["temperature"], b["top_p"], b["top_k"]) == (0.7, 0.8, 20)


def test_short_replies_are_counted():
    s = Settings(concurrencies=[1], rounds=1, warmup=0, max_tokens=FAKE_TOKENS + 1,
                 ttft=False, request_timeout=10.0, connect_timeout=5.0)
    res, _ = _run_against_fake(s)
    assert [r.short for r in res.throughput_rounds] == [1, 1]
    assert "shorter than max_tokens" in report.markdown(res)


def test_http_error_stops_the_run_and_is_reported():
    async def go():
        fake = FakeOpenAI(["a"])
        await fake.start()
        try:
            s = Settings(concurrencies=[2], rounds=1, warmup=0, ttft=False,
                         request_timeout=10.0, connect_timeout=5.0)
            targets = [Target("A", fake.base("a")), Target("missing", fake.base("nope"), "m")]
            return await asyncio.wait_for(run(targets, s, progress=lambda _l: None),
                                          TEST_DEADLINE)
        finally:
            await fake.stop()
    res = asyncio.run(go())
    assert res.error is not None and "404" in res.error
    assert [r.target for r in res.throughput_rounds] == ["A"]  # what ran before is kept
    assert "Stopped early" in report.markdown(res)


def test_round_ratios_pair_the_targets_round_by_round():
    s = Settings(concurrencies=[2], rounds=3, warmup=1)
    res = Results(targets=[Target("a", "http://x"), Target("b", "http://y")], settings=s)
    rows = [("a", 0, True, 500.0), ("b", 0, True, 100.0),     # warm-up: left out
            ("a", 1, False, 90.0), ("b", 1, False, 100.0),
            ("a", 2, False, 120.0), ("b", 2, False, 100.0),
            ("a", 3, False, 50.0), ("b", 3, False, 50.0)]
    for target, rnd, warm, tok_s in rows:
        res.throughput_rounds.append(ThroughputRound(
            target=target, concurrency=2, round=rnd, warmup=warm,
            completion_tokens=[1], wall_s=1.0, tok_s=tok_s, short=0))
    assert res.round_ratios("a", "b", 2) == pytest.approx([0.9, 1.2, 1.0])
    assert res.round_ratios("a", "b", 4) == []
    table = report.markdown(res)
    assert "| round by round: median (rounds a led) | 1.00 (2/3) |" in table
    assert res.to_json()["round_ratios"] == {"a/b": {"2": pytest.approx([0.9, 1.2, 1.0])}}
