"""Agents + interactive chat: eight agents (``agent`` class) stream replies to ~6k-token prompts;
once they are all in flight an interactive chat (``x-superfluid-qos: interactive``) is sent.

Pass: the chat's first token arrives within 1.0 s of its send, every agent completes, and the
chat really overlapped the agents (it was sent before any agent had finished). The prompts are tools/bench/agents_chat.py's. The timeline of every request
(queued / prefilling / decoding, from polling superfluid's /slots; send → first token → done on
peers) is kept for the chart."""

from __future__ import annotations

import asyncio
import time

from tools.bench.agents_chat import agent_prompt

from ..common import ERROR, Outcome, rnd, stream, verdict
from ..targets import MODEL_NAME, ServeConfig

KEY, TITLE = "agents_chat", "agents + interactive chat"
FULL = {"agents": 8, "prompt_tokens": 6000, "agent_tokens": 32, "chat_tokens": 16, "chat_delay": 2.0,
        "lanes": 8, "context": 8192, "ttft_bound": 1.0}
# FAST: two agents still hold both lanes for seconds after the chat is sent (~600 prompt tokens and
# 120 reply tokens each), so without QoS the chat waits well past the bound (the failing test).
FAST = {"agents": 2, "prompt_tokens": 600, "agent_tokens": 120, "chat_tokens": 8, "chat_delay": 0.6,
        "lanes": 2, "context": 2048, "ttft_bound": 1.0}
CHAT = "Say hello in five words."


def unsupported(kind):
    return None


def config(kind, p, state_dir) -> ServeConfig:
    return ServeConfig(lanes=p["lanes"], context=p["context"])


async def _poll_slots(ctx, t0, samples, stop):
    """superfluid's /slots every 0.1 s: (t, request_id, state, prompt_tokens)."""
    while not stop.is_set():
        r = await ctx.get("/slots")
        t = time.monotonic() - t0
        if r.status == 200:
            m = r.body["models"][MODEL_NAME]
            for s in m["slots"]:
                if s.get("request_id"):
                    samples.append((round(t, 3), s["request_id"], s["state"], s.get("prompt_tokens")))
            for q in m.get("queue", []):
                samples.append((round(t, 3), q["request_id"], "queued", None))
        try:
            await asyncio.wait_for(stop.wait(), 0.1)
        except asyncio.TimeoutError:
            pass


def _phases(rec, rid_samples):
    """[(state, start, end)] of one request: from /slots samples when there are any, else
    'waiting' (send → first token) and 'decoding' (first token → done)."""
    if rid_samples:
        out = []
        start = rec["sent"]
        state = "queued"
        for t, st in rid_samples:
            if st != state:
                out.append((state, start, t))
                state, start = st, t
        out.append((state, start, rec["done"]))
        return [ph for ph in out if ph[2] > ph[1]]
    ft = rec["first_token"] if rec["first_token"] is not None else rec["done"]
    return [("waiting", rec["sent"], ft), ("decoding", ft, rec["done"])]


def _match(records, samples):
    """Map /slots request ids to our requests by prompt length (agents' prompts differ in length)."""
    ids = {}
    for _t, rid, _st, pt in samples:
        if pt is not None and rid not in ids:
            ids[rid] = pt
    by_rid = {}
    for rid, pt in ids.items():
        for rec in records:
            if rec.get("prompt_tokens") == pt and "rid" not in rec:
                rec["rid"] = rid
                by_rid[rid] = rec
                break
    per = {}
    for t, rid, st, _pt in samples:
        if rid in by_rid:
            per.setdefault(rid, []).append((t, st))
    for rec in records:
        rec["phases"] = _phases(rec, per.get(rec.get("rid"), []))


async def run(ctx) -> Outcome:
    p = ctx.p
    prompts = [agent_prompt(i, p["prompt_tokens"] + 26 * i) for i in range(p["agents"])]
    t0 = time.monotonic()
    samples, stop = [], asyncio.Event()
    poller = asyncio.create_task(_poll_slots(ctx, t0, samples, stop)) if ctx.kind == "superfluid" else None
    agents = [asyncio.create_task(stream(
        ctx.http, f"{ctx.base}/v1/completions",
        {"model": MODEL_NAME, "prompt": pr, "max_tokens": p["agent_tokens"], "temperature": 0,
         "ignore_eos": True, "stream_options": {"include_usage": True}},
        headers={"x-superfluid-qos": "agent"}, timeout=1800)) for pr in prompts]
    await asyncio.sleep(p["chat_delay"])
    chat = await stream(ctx.http, f"{ctx.base}/v1/chat/completions",
                        {"model": MODEL_NAME, "messages": [{"role": "user", "content": CHAT}],
                         "max_tokens": p["chat_tokens"], "temperature": 0,
                         "stream_options": {"include_usage": True}},
                        headers={"x-superfluid-qos": "interactive"}, timeout=1800)
    results = await asyncio.gather(*agents)
    stop.set()
    if poller:
        await poller
    records = []
    for i, r in enumerate(results):
        rec = {"name": f"agent {i}", **r.to_json(t0),
               "prompt_tokens": (r.usage or {}).get("prompt_tokens")}
        records.append(rec)
    chat_rec = {"name": "chat", **chat.to_json(t0), "prompt_tokens": (chat.usage or {}).get("prompt_tokens")}
    records.append(chat_rec)
    _match(records, samples)
    if chat.error and chat.status != 200:
        return Outcome(KEY, ctx.name, ERROR, f"chat failed: {chat.error}", {"requests": records})
    agents_ok = sum(1 for r in results if r.status == 200 and not r.error)
    overlapped = all(r.done > chat.sent for r in results)  # the chat arrived while every agent ran
    ttft = chat.ttft
    figures = {"chat_ttft_s": rnd(ttft), "ttft_bound_s": p["ttft_bound"], "agents": p["agents"],
               "agents_completed": agents_ok, "chat_overlapped_agents": overlapped,
               "agent_prompt_tokens": [rec["prompt_tokens"] for rec in records[:-1]],
               "wall_s": rnd(max(r.done for r in results + [chat]) - t0, 2),
               "slots_polled": ctx.kind == "superfluid", "requests": records}
    ok = ttft is not None and ttft <= p["ttft_bound"] and agents_ok == p["agents"] and overlapped
    ttft_s = "none" if ttft is None else f"{ttft:.2f} s"
    v, why = verdict(ok, f"chat TTFT {ttft_s} behind {p['agents']} agents",
                     f"chat TTFT {ttft_s} (bound {p['ttft_bound']} s), {agents_ok}/{p['agents']} agents "
                     f"completed, overlapped={overlapped}")
    return Outcome(KEY, ctx.name, v, why, figures)
