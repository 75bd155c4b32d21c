"""Shared-prefix burst: 32 requests sharing a ~4.8k-token prefix (tools/bench/shared_prefix.py's
workload: ``--prefix-tokens 4000`` of its text) arrive at once.

Pass: all 32 complete and the shared prefix was prefilled at most 1.0 times in total: (prefilled
tokens − the distinct suffixes) / shared prefix tokens, with prefilled tokens from
superfluid_prefill_tokens_total, llama-server's llamacpp:prompt_tokens_total (--metrics), or
llama-cpp-python's logged ``prompt eval … tokens``."""

from __future__ import annotations

import argparse

from tools.bench import shared_prefix as bench

from ..common import Outcome, rnd, verdict
from ..targets import MODEL_NAME, ServeConfig, logged_prefill_tokens

KEY, TITLE = "shared_prefix", "shared-prefix burst"
FULL = {"requests": 32, "prefix_tokens": 4000, "lanes": 8, "context": 8192, "max_times": 1.0}
FAST = {"requests": 6, "prefix_tokens": 700, "lanes": 2, "context": 2048, "max_times": 1.0}


def unsupported(kind):
    return None


def config(kind, p, state_dir) -> ServeConfig:
    return ServeConfig(lanes=p["lanes"], context=p["context"])


async def run(ctx) -> Outcome:
    p = ctx.p
    args = argparse.Namespace(requests=p["requests"], prefix_tokens=p["prefix_tokens"], model=MODEL_NAME,
                              timeout=1800.0)
    log0 = logged_prefill_tokens(ctx.server.log_text())
    out = await bench.run_target(ctx.name, ctx.base, args, session=ctx.http)
    if out["times_prefix_prefilled"] is None and ctx.kind == "llama-cpp-python":
        if not out["prompt_tokens"]:  # its streams carry no usage: count with its tokenizer route
            counts = []
            for text in bench.prompts(args):
                r = await ctx.post("/extras/tokenize/count", {"input": text})
                if r.status == 200 and isinstance(r.body, dict):
                    counts.append(r.body.get("count"))
            out["prompt_tokens"] = [c for c in counts if c]
            if out["prompt_tokens"]:
                out["shared_prefix_tokens"] = min(out["prompt_tokens"]) - 24
        prefilled = logged_prefill_tokens(ctx.server.log_text()) - log0
        out["prefilled_tokens"] = prefilled
        out["times_prefix_prefilled"] = bench.times_prefilled(prefilled, out["prompt_tokens"])
    times = out["times_prefix_prefilled"]
    figures = {k: v for k, v in out.items() if k != "target"}
    ok = out["completed"] == p["requests"] and times is not None and times <= p["max_times"]
    v, why = verdict(ok, f"{out['completed']}/{p['requests']} completed, prefix prefilled {times:.2f} times" if ok else "",
                     f"{out['completed']}/{p['requests']} completed, prefix prefilled {rnd(times, 2)} times "
                     f"(allowed {p['max_times']})")
    return Outcome(KEY, ctx.name, v, why, figures)
