"""tools.bench.fleet without nodes: its prompts, the head-health reader, the metrics sums, the
stream classifier, the report table, and its client against a small fake upstream (an aiohttp
app on a loopback port, named as such) that completes, errors, cuts and hangs streams."""

import asyncio
import json

import aiohttp
import pytest
from aiohttp import web

from tools.bench import fleet, fleet_prompts as fp
from tools.bench.fleet_procs import metric_sums, node_state
from tools.bench.fleet_report import markdown
from tools.bench.fleet_requests import StreamState, chat, chat_body, tally


def test_families_are_distinct_from_the_first_words_and_interleaved():
    prefixes = [fp.prefix(k, 1000) for k in range(4)]
    assert len({p[:20] for p in prefixes}) == 4
    assert all(900 * 3 < len(p) < 1300 * 5 for p in prefixes)  # ~1k tokens at 3-5 chars a token
    reqs = fp.affinity_requests(48, 4, 1000)
    assert [f for f, _ in reqs[:6]] == [0, 1, 2, 3, 0, 1]
    assert len({m[1]["content"] for _, m in reqs}) == 48  # every question its own
    assert all(m[0]["content"] == prefixes[f] for f, m in reqs)


def test_burst_and_agent_prompts_are_distinct():
    assert len({m[0]["content"] for m in fp.burst_messages(30, "k")}) == 30
    agents = [fp.agent_messages(i, 2500)[0]["content"] for i in range(8)]
    assert len(set(agents)) == 8 and all(len(a) > 7000 for a in agents)


def test_chat_body_carries_the_class_in_the_superfluid_field():
    body = chat_body("m", [{"role": "user", "content": "hi"}], 4, True, "interactive")
    assert body["superfluid"] == {"qos": "interactive"} and body["stream_options"] == {"include_usage": True}
    assert "superfluid" not in chat_body("m", [], 4, False, None)


def test_node_state_reads_smg_workers_and_fleet_nodes():
    smg = {"workers": [{"url": "http://127.0.0.1:1", "is_healthy": False, "status": "failed"},
                       {"url": "http://127.0.0.1:2/", "is_healthy": True}]}
    assert node_state(smg, "http://127.0.0.1:1") is False
    assert node_state(smg, "http://127.0.0.1:2") is True
    assert node_state(smg, "http://127.0.0.1:3") is None
    assert node_state({"nodes": {"http://a:1": {"healthy": True}, "http://b:2": "down"}}, "http://b:2") is False
    assert node_state({"nodes": [{"url": "http://a:1", "status": "ok"}]}, "http://a:1") is True
    assert node_state("OK", "http://a:1") is None
    head = {"status": "ok", "nodes": {"http://a:1": {"url": "http://a:1", "state": "unhealthy", "routed": True},
                                      "http://b:2": {"url": "http://b:2", "state": "unknown", "routed": False}}}
    assert node_state(head, "http://a:1") is False and node_state(head, "http://a:1", "routed") is True
    assert node_state(head, "http://b:2") is None and node_state(head, "http://b:2", "routed") is False


def test_metric_sums_add_labels_up():
    text = ('# TYPE superfluid_prefill_tokens_total counter\n'
            'superfluid_prefill_tokens_total{model="a"} 10.0\nsuperfluid_prefill_tokens_total{model="b"} 5.0\n'
            '# TYPE superfluid_requests_total counter\n'
            'superfluid_requests_total{finish_reason="length",model="a"} 2.0\n'
            'superfluid_requests_total{finish_reason="stop",model="a"} 3.0\n')
    sums = metric_sums(text)
    assert sums["superfluid_prefill_tokens_total"] == 15.0 and sums["superfluid_requests_total"] == 5.0


def test_stream_state_classifies():
    ok = StreamState()
    assert not ok.feed(b'data: {"choices":[{"delta":{"role":"assistant","content":""}}]}\n')
    assert ok.feed(b'data: {"choices":[{"delta":{"content":"Hi"}}]}\n')
    ok.feed(b": keep-alive\n")
    ok.feed(b"data: [DONE]\n")
    assert ok.outcome() == "completed" and ok.events == 3
    cut = StreamState()
    cut.feed(b'data: {"choices":[{"delta":{"content":"Hi"}}]}\n')
    assert cut.outcome() == "truncated"
    err = StreamState()
    err.feed(b'data: {"choices":[{"delta":{"content":"Hi"}}]}\n')
    err.feed(b'data: {"error":{"message":"node died","type":"stream_error"}}\n')
    err.feed(b"data: [DONE]\n")
    assert err.outcome() == "error" and err.error == "node died"


def test_percentile_is_nearest_rank():
    assert fleet.percentile([], 0.5) is None
    assert fleet.percentile([3.0, 1.0, 2.0], 0.5) == 2.0
    assert fleet.percentile(list(range(1, 201)), 0.99) == 198


def test_arguments_and_an_unknown_stage():
    args = fleet.parser().parse_args(["--out", "x"])
    assert args.requests == 48 and args.families == 4 and args.agents == 8 and args.overhead_n == 200
    assert fleet.main(["--out", "/nonexistent-never-made", "--only", "nope"]) == 2


def test_report_from_a_canned_run():
    run = {"prefilled_per_node": [1200.0, 1300.0, 0.0], "prefilled_total": 2500.0, "requests_per_node": [24, 24, 0],
           "completed": 48, "sent": 48, "prompt_tokens_min": 1080, "prompt_tokens_max": 1090, "wall_s": 40.0}
    rr = dict(run, prefilled_total=7500.0, prefilled_per_node=[2500.0] * 3, requests_per_node=[16] * 3)
    counts = {"sent": 30, "completed": 25, "error": 5, "truncated": 0, "lost": 0,
              "errors": {"error stream: Stream error: unexpected EOF": 5}}
    results = {
        "date": "2026-12-01", "commit": "abc", "head": "fleet", "command": "python -m tools.bench.fleet --out d",
        "affinity": {"requests": 48, "families": 4, "prefix_tokens_asked": 1000, "concurrency": 6,
                     "runs": {"cache_aware": run, "round_robin": rr}, "ratio_cache_aware_to_round_robin": 1 / 3,
                     "goal": 0.5},
        "kill": {"burst": 30, "streamed": 15, "max_tokens": 48, "victim": 0, "killed_after_s": 4.1,
                 "victim_busy_at_kill": 10, "busy_per_node_at_kill": [10, 10, 10], "counts": counts,
                 "streams": dict(counts, sent=15, completed=10), "unhealthy_after_s": 1.9, "unrouted_after_s": 2.1,
                 "probes": {"sent": 48, "completed": 48, "errors": {}, "interval_s": 0.25, "seconds": 12.0,
                            "last_failed_sent_after_kill_s": None},
                 "rejoin": {"restart_ready_s": 4.2, "routed_at_head_after_ready_s": 0.8,
                            "requests": {"sent": 12, "completed": 12}, "requests_per_node": [4, 4, 4]}},
        "refusals": {"runs": [{"flags": ["--class-lanes", "agent=2"], "rc": 2,
                               "message": "superfluid fleet: configuration error: --class-lanes is a node setting"}]},
        "qos": {"error": "RuntimeError: node0 exited"},
        "overhead": {"request": "chat", "n": 200, "routes": {"direct": {"n": 200, "p50_ms": 30.0, "p99_ms": 45.0},
                                                            "head": {"n": 200, "p50_ms": 32.0, "p99_ms": 50.0}},
                     "added": {"head": {"p50_ms": 2.0, "p99_ms": 5.0}}},
    }
    text = markdown(results)
    assert "| cache_aware | 2500 | [1200, 1300, 0] |" in text and "**0.33**" in text
    assert "| 30 | 25 | 5 | 0 | 0 |" in text and "5× error stream" in text and "**1.90 s**" in text and "**2.10 s**" in text
    assert "QoS through the head: failed: RuntimeError" in text
    assert "| `--class-lanes agent=2` | 2 | superfluid fleet: configuration error: --class-lanes" in text
    qos = {"agents": 8, "agent_tokens_asked": 2500, "lanes_per_node": 2, "per_node_at_chat": [], "goal_s": 1.0,
           "chats": {"interactive (body field)": {"ttft": 0.4, "kind": "completed"},
                     "agent (peer)": {"ttft": None, "kind": "lost", "error": "no answer within 120 s"}}}
    qos_text = markdown({"qos": qos})
    assert "| interactive (body field) | **0.40** | completed |" in qos_text
    assert "| agent (peer) | - | lost: no answer within 120 s |" in qos_text
    assert "| head | 200 | 32.00 | 50.00 | 2.00 | 5.00 |" in text
    assert tally([])["sent"] == 0
    faults = {"down_at_start": {"head_health_status": 200, "late_node_healthy": False, "late_node_routed": False,
                                "chat": {"kind": "completed", "status": 200}, "started_ready_s": 3.0,
                                "routed_after_ready_s": 1.1},
              "unknown_model": {"status": 404, "error": "No worker available for model 'x'"},
              "all_down": {"unhealthy_after_s": 2.0, "head_health_status": 503,
                           "chat": {"status": 503, "error": "no workers"}}}
    text = markdown({"faults": faults})
    assert "routed to 1.10 s after it answers" in text and "HTTP 404 `None`: No worker" in text
    assert "HTTP 503 `None`: no" in text


# ---- the client against a fake upstream -----------------------------------------------------------

async def _fake_upstream(request: web.Request) -> web.StreamResponse:
    """A fake chat server (not superfluid): the user text picks what it does."""
    body = await request.json()
    mode = body["messages"][0]["content"]
    if mode == "status":
        return web.json_response({"error": {"message": "model 'x' not found", "type": "invalid_request_error",
                                            "code": "model_not_found"}},
                                 status=404)
    if not body.get("stream"):
        if mode == "hang":
            await asyncio.sleep(2)
        return web.json_response({"choices": [{"message": {"content": "ok"}}], "usage": {"prompt_tokens": 7}},
                                 headers={"x-smg-routed-worker-id": "http://node:1"})
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    await resp.write(b'data: {"choices":[{"delta":{"content":"Hi"}}]}\n\n')
    if mode == "ok":
        await resp.write(b"data: [DONE]\n\n")
    elif mode == "error":
        await resp.write(b'data: {"error":{"message":"node died","type":"stream_error","code":"stream_cut"}}\n\n'
                         b"data: [DONE]\n\n")
    elif mode == "hang":
        await asyncio.sleep(2)
    # "cut": end the body with neither [DONE] nor an error
    return resp


@pytest.fixture
def upstream():
    loop = asyncio.new_event_loop()
    app = web.Application()
    app.router.add_post("/v1/chat/completions", _fake_upstream)
    runner = web.AppRunner(app)
    loop.run_until_complete(runner.setup())
    site = web.TCPSite(runner, "127.0.0.1", 0)
    loop.run_until_complete(site.start())
    port = site._server.sockets[0].getsockname()[1]
    yield loop, f"http://127.0.0.1:{port}"
    loop.run_until_complete(runner.cleanup())
    loop.close()


def test_chat_outcomes_against_a_fake_upstream(upstream):
    loop, base = upstream

    async def go():
        async with aiohttp.ClientSession() as s:
            def send(mode, stream):
                return chat(s, base, chat_body("m", [{"role": "user", "content": mode}], 4, stream, None),
                            timeout=1.0, read_timeout=0.5)
            return await asyncio.gather(send("ok", True), send("error", True), send("cut", True),
                                        send("hang", True), send("ok", False), send("hang", False),
                                        send("status", False))

    ok, err, cut, hang, whole, hung, status = loop.run_until_complete(go())
    assert ok.kind == "completed" and ok.ttft is not None and ok.ttft < 1.0
    assert err.kind == "error" and err.error == "node died" and err.code == "stream_cut"
    assert cut.kind == "truncated"
    assert hang.kind == "lost" and hang.seconds < 1.5
    assert whole.kind == "completed" and whole.prompt_tokens == 7 and whole.worker == "http://node:1"
    assert hung.kind == "lost"
    assert status.kind == "error" and status.status == 404 and "not found" in status.error
    assert status.code == "model_not_found"
    counts = tally([ok, err, cut, hang, whole, hung, status])
    assert (counts["completed"], counts["error"], counts["truncated"], counts["lost"]) == (2, 2, 1, 2)
    assert json.dumps([o.to_json() for o in (ok, err)])
