"""KV exhaustion: far more live context than the KV pool holds. 32 requests, each a distinct
~3k-token prompt with a 256-token reply, arrive at once at a server with 8 lanes of 4096 tokens
(superfluid's pool: 10 × 4096 cells; llama-server: -np 8 -c 32768), so about 2.5 pools of context
are asked for.

Pass: every request answers 200 with a whole reply (a finish_reason of stop or length) within
the bound, no connection is reset, and the server is still healthy afterwards."""

from __future__ import annotations

import asyncio
import time

from tools.bench.agents_chat import agent_prompt

from ..common import Outcome, call, median, rnd, verdict
from ..targets import MODEL_NAME, ServeConfig

KEY, TITLE = "kv_exhaustion", "KV exhaustion"
FULL = {"requests": 32, "prompt_tokens": 3000, "max_tokens": 256, "lanes": 8, "context": 4096,
        "request_timeout": 1800.0}
# FAST: still more context than the pool (6 × ~400 tokens against 4 sequences × 512 cells, ~1.2 pools)
FAST = {"requests": 6, "prompt_tokens": 350, "max_tokens": 48, "lanes": 2, "context": 512,
        "request_timeout": 300.0}


def unsupported(kind):
    return None


def config(kind, p, state_dir) -> ServeConfig:
    return ServeConfig(lanes=p["lanes"], context=p["context"])


def _body(kind, p, i):
    b = {"model": MODEL_NAME, "prompt": agent_prompt(100 + i, p["prompt_tokens"]),
         "max_tokens": p["max_tokens"], "temperature": 0}
    if kind == "mlx-lm":  # ignores ignore_eos: SmolLM2's end tokens biased away instead
        b["logit_bias"] = {"0": -100, "1": -100, "2": -100}
    elif kind != "llama-cpp-python":
        b["ignore_eos"] = True
    return b


async def _one(ctx, p, i):
    try:
        r = await call(ctx.http, "POST", f"{ctx.base}/v1/completions", _body(ctx.kind, p, i),
                       timeout=p["request_timeout"])
    except Exception as e:  # reset, timeout
        return {"ok": False, "error": f"{type(e).__name__}: {e}"[:300]}
    body = r.body if isinstance(r.body, dict) else {}
    choice = (body.get("choices") or [{}])[0]
    ok = r.status == 200 and choice.get("finish_reason") in ("stop", "length")
    return {"ok": ok, "status": r.status, "seconds": round(r.seconds, 2),
            "prompt_tokens": (body.get("usage") or {}).get("prompt_tokens"),
            "completion_tokens": (body.get("usage") or {}).get("completion_tokens"),
            "error": None if ok else str(r.body)[:300]}


async def run(ctx) -> Outcome:
    p = ctx.p
    pool = None
    if ctx.kind == "superfluid":  # the worker's context: every lane's KV cells (/slots has it only after a tick)
        s = await ctx.get("/health")
        m = s.body["models"][MODEL_NAME] if s.status == 200 else {}
        # llama.cpp's context, or basert's paged pool (blocks x block size)
        pool = m.get("n_ctx") or (m.get("kv_blocks", 0) * m.get("block_size", 0)) or None
    elif ctx.kind == "llama-server":
        pool = p["lanes"] * p["context"]
    elif ctx.kind == "llama-cpp-python":
        pool = p["context"]
    t0 = time.monotonic()
    results = await asyncio.gather(*[_one(ctx, p, i) for i in range(p["requests"])])
    wall = time.monotonic() - t0
    h = await ctx.get("/health" if ctx.kind != "llama-cpp-python" else "/v1/models")  # mlx-lm has /health
    completed = sum(r["ok"] for r in results)
    demanded = sum((r.get("prompt_tokens") or 0) + (r.get("completion_tokens") or 0) for r in results)
    figures = {"requests": p["requests"], "completed": completed, "wall_s": rnd(wall, 1),
               "median_latency_s": rnd(median([r.get("seconds") for r in results if r["ok"]]), 2),
               "context_tokens_demanded": demanded, "kv_pool_cells": pool,
               "demand_over_pool": rnd(demanded / pool, 2) if pool else None,
               "healthy_after": h.status == 200, "alive_after": ctx.server.alive(),
               "errors": [r["error"] for r in results if not r["ok"]][:3]}
    ok = completed == p["requests"] and h.status == 200 and ctx.server.alive()
    v, why = verdict(ok, f"{completed}/{p['requests']} completed in {wall:.0f} s",
                     f"{completed}/{p['requests']} completed, healthy after={h.status == 200}")
    return Outcome(KEY, ctx.name, v, why, figures)
