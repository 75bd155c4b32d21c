"""Client disconnect: a client goes away while its request is queued, while it is prefilling and
while it is decoding.

Each state in turn on a server with 2 lanes: *decoding* — a long streamed reply, dropped after 5
chunks; *prefilling* — a ~3k-token prompt dropped while the server prefills it (superfluid's
/slots shows the state; peers: 0.4 s after the send); *queued* — both lanes held by long streams,
a third request dropped while it waits, then the two holders dropped.

Pass: within 5 s of each drop the server shows the work gone — superfluid: /slots has no lane
for it and an empty queue, and at the end every lane is free, no KV is held by a live lane
(kv_used ≤ kv_cached), and /metrics agrees (lanes_busy 0, queue_depth 0, one more
requests_total{finish_reason="cancelled"} per dropped request); llama-server: /slots shows no slot
processing and /metrics no deferred request; llama-cpp-python and mlx_lm.server (no such view): a
short probe request sent after the drop completes within 5 s."""

from __future__ import annotations

import asyncio
import time

from tools.bench.agents_chat import agent_prompt

from ..common import Outcome, call, metric_sum, metrics, rnd, stream, verdict
from ..targets import MODEL_NAME, NO_IGNORE_EOS, NO_LANE_VIEW, ServeConfig

KEY, TITLE = "disconnect", "client disconnect"
FULL = {"lanes": 2, "context": 4096, "prefill_tokens": 3000, "long_tokens": 3000, "bound": 5.0}
FAST = {"lanes": 2, "context": 2048, "prefill_tokens": 1500, "long_tokens": 1500, "bound": 5.0}
SHORT = "<|im_start|>user\nWrite a very long story about a dragon.<|im_end|>\n<|im_start|>assistant\n"


def unsupported(kind):
    return None


def config(kind, p, state_dir) -> ServeConfig:
    return ServeConfig(lanes=p["lanes"], context=p["context"])


def _long_body(ctx, prompt=SHORT, max_tokens=None):
    b = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens or ctx.p["long_tokens"], "temperature": 0}
    if ctx.kind in NO_IGNORE_EOS:
        b["logit_bias"] = {"0": -100, "1": -100, "2": -100}  # SmolLM2's end tokens: keep it going
    else:
        b["ignore_eos"] = True
    return b


async def _state(ctx):
    """(busy lanes, queued, detail) or None where the server has no such view."""
    if ctx.kind == "superfluid":
        r = await ctx.get("/slots")
        m = r.body["models"][MODEL_NAME]
        busy = [s for s in m["slots"] if s.get("request_id")]
        return len(busy), m["queued"], {"states": [s["state"] for s in busy], "kv_used": m.get("kv_used"),
                                        "kv_cached": m.get("kv_cached")}
    if ctx.kind == "llama-server":
        r = await ctx.get("/slots")
        busy = sum(1 for s in (r.body or []) if s.get("is_processing"))
        deferred = metric_sum(await metrics(ctx.http, ctx.base), "llamacpp:requests_deferred") or 0
        return busy, int(deferred), {}
    return None


async def _wait(ctx, busy, queued, bound):
    """Seconds until the server shows at most ``busy`` lanes and ``queued`` waiting; None past bound."""
    t0 = time.monotonic()
    if await _state(ctx) is None:  # probe: a short request must get through
        try:
            r = await call(ctx.http, "POST", f"{ctx.base}/v1/completions",
                           {"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 2}, timeout=bound)
            return time.monotonic() - t0 if r.status == 200 else None
        except Exception:
            return None
    while time.monotonic() - t0 < bound:
        b, q, _ = await _state(ctx)
        if b <= busy and q <= queued:
            return time.monotonic() - t0
        await asyncio.sleep(0.05)
    return None


def _streamer(ctx, body, chunks_wanted):
    got = asyncio.Event()

    def on_chunk(res):
        if res.chunks >= chunks_wanted:
            got.set()
    task = asyncio.create_task(stream(ctx.http, f"{ctx.base}/v1/completions", body, timeout=600, on_chunk=on_chunk))
    return task, got


async def _drop(task):
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def _until(pred, timeout, step=0.02):
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if await pred():
            return True
        await asyncio.sleep(step)
    return False


async def run(ctx) -> Outcome:
    p, bound = ctx.p, ctx.p["bound"]
    sf = ctx.kind == "superfluid"
    before = await metrics(ctx.http, ctx.base) if sf else None
    cancelled0 = metric_sum(before, "superfluid_requests_total", finish_reason="cancelled") or 0
    res = {}
    # decoding
    task, got = _streamer(ctx, _long_body(ctx), 5)
    await asyncio.wait_for(got.wait(), 120)
    await _drop(task)
    res["decoding"] = {"freed_s": rnd(await _wait(ctx, 0, 0, bound))}
    # prefilling
    body = _long_body(ctx, agent_prompt(7, p["prefill_tokens"]), 16)
    task = asyncio.create_task(call(ctx.http, "POST", f"{ctx.base}/v1/completions", body, timeout=600))
    seen = None
    if sf:
        async def prefilling():
            nonlocal seen
            st = await _state(ctx)
            seen = st[2]["states"][0] if st[2]["states"] else seen
            return seen == "prefilling"
        await _until(prefilling, 30)
    else:
        await asyncio.sleep(0.4)
    await _drop(task)
    res["prefilling"] = {"freed_s": rnd(await _wait(ctx, 0, 0, bound)), "state_seen": seen}
    # queued
    holders = [_streamer(ctx, _long_body(ctx, SHORT.replace("dragon", f"dragon {k}")), 2) for k in range(p["lanes"])]
    await asyncio.wait_for(asyncio.gather(*[g.wait() for _t, g in holders]), 120)
    task = asyncio.create_task(stream(ctx.http, f"{ctx.base}/v1/completions", _long_body(ctx), timeout=600))
    queued_seen = None
    if ctx.kind not in NO_LANE_VIEW:
        async def is_queued():
            nonlocal queued_seen
            st = await _state(ctx)
            queued_seen = st[1]
            return st[1] >= 1
        await _until(is_queued, 10)
    else:
        await asyncio.sleep(0.4)
    await _drop(task)
    if ctx.kind in NO_LANE_VIEW:
        q_freed = None  # its probe would wait behind the holders; checked with them below
    else:
        q_freed = await _wait(ctx, p["lanes"], 0, bound)
    for t, _g in holders:
        await _drop(t)
    all_freed = await _wait(ctx, 0, 0, bound)
    res["queued"] = {"queue_emptied_s": rnd(q_freed), "queued_seen": queued_seen, "then_all_freed_s": rnd(all_freed)}
    figures = {"states": res}
    checks = [res["decoding"]["freed_s"] is not None, res["prefilling"]["freed_s"] is not None,
              all_freed is not None]
    if ctx.kind not in NO_LANE_VIEW:
        checks.append(q_freed is not None)
    if sf:
        await asyncio.sleep(0.3)
        after = await metrics(ctx.http, ctx.base)
        st = await _state(ctx)
        dropped = 2 + 1 + p["lanes"]
        cancelled = (metric_sum(after, "superfluid_requests_total", finish_reason="cancelled") or 0) - cancelled0
        consistent = {"lanes_busy": metric_sum(after, "superfluid_lanes_busy"),
                      "queue_depth": metric_sum(after, "superfluid_queue_depth"),
                      "cancelled": cancelled, "dropped": dropped,
                      "kv_used": st[2]["kv_used"], "kv_cached": st[2]["kv_cached"]}
        figures["end"] = consistent
        kv_ok = consistent["kv_used"] is not None and consistent["kv_cached"] is not None \
            and consistent["kv_used"] <= consistent["kv_cached"]
        checks += [consistent["lanes_busy"] == 0, consistent["queue_depth"] == 0, cancelled == dropped, kv_ok,
                   seen == "prefilling", (queued_seen or 0) >= 1]
    ok = all(checks)
    v, why = verdict(ok, "every dropped request freed within "
                     f"{max(x for x in [res['decoding']['freed_s'], res['prefilling']['freed_s'], all_freed, q_freed] if x is not None):.2f} s",
                     f"not freed or inconsistent: {res}" + (f", end {figures.get('end')}" if sf else ""))
    return Outcome(KEY, ctx.name, v, why, figures)
