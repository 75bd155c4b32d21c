"""Shared-prefix burst: N requests that share a long prompt prefix arrive at once. Reports how
many times the shared prefix was prefilled in total (from the server's own counters) and the
median time to first token.

    python -m tools.bench.shared_prefix --target superfluid=http://127.0.0.1:8080 \\
        --target llama-server=http://127.0.0.1:8081 --requests 32 --prefix-tokens 4000

Prefill counts come from `superfluid_prefill_tokens_total` on superfluid and from
`llamacpp:prompt_tokens_total` on llama-server (start it with `--metrics`). A server with no such
counter but with `usage.prompt_tokens_details.cached_tokens` in its streams (mlx_lm.server) is
counted from those: each request prefilled its prompt less its cached tokens. Targets run one
after the other.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time

import aiohttp

from .client import first_model

COUNTERS = ("superfluid_prefill_tokens_total", "llamacpp:prompt_tokens_total")
SENTENCE = "Section {i}: the service keeps a write-ahead log, replicates it to two peers and compacts it nightly. "


def shared_prefix(tokens: int) -> str:
    body = "".join(SENTENCE.format(i=i) for i in range(max(1, tokens // 22)))
    return f"<|im_start|>system\nYou answer questions about this design document.\n{body}<|im_end|>\n<|im_start|>user\n"


async def prefilled(session, base) -> float | None:
    """The server's prefilled-token counter; None when it has no metrics (0 before the first tick)."""
    try:
        async with session.get(f"{base}/metrics", timeout=aiohttp.ClientTimeout(total=10)) as r:
            if r.status != 200:
                return None
            text = await r.text()
    except aiohttp.ClientError:
        return None
    total = 0.0
    for line in text.splitlines():
        name = line.split("{")[0].split(" ")[0]
        if name in COUNTERS:
            total += float(line.rsplit(" ", 1)[1])
    return total


async def one(session, base, model, prompt, timeout):
    t0 = time.monotonic()
    ttft = None
    async with session.post(f"{base}/v1/completions", json={
            "model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}},
            timeout=aiohttp.ClientTimeout(total=timeout)) as r:
        usage = None
        async for raw in r.content:
            line = raw.decode(errors="replace").strip()
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            if ttft is None and any(c.get("text") for c in chunk.get("choices") or []):
                ttft = time.monotonic() - t0
    cached = ((usage or {}).get("prompt_tokens_details") or {}).get("cached_tokens")
    return {"ttft": ttft, "seconds": time.monotonic() - t0, "ok": r.status == 200,
            "prompt_tokens": (usage or {}).get("prompt_tokens"), "cached_tokens": cached}


def prompts(args) -> list[str]:
    """The burst: ``args.requests`` prompts sharing ``shared_prefix(args.prefix_tokens)``."""
    prefix = shared_prefix(args.prefix_tokens)
    return [prefix + f"Question {i}: which peer compacts section {i}?<|im_end|>\n<|im_start|>assistant\n"
            for i in range(args.requests)]


def times_prefilled(prefilled: float | None, prompt_tokens: list[int]) -> float | None:
    """How many times the shared prefix was prefilled, given the tokens prefilled for the whole
    burst and each prompt's length: the prefix is what every prompt shares (conservatively the
    shortest prompt less 24 suffix tokens); each prompt's rest is its own suffix."""
    if prefilled is None or not prompt_tokens:
        return None
    shared = min(prompt_tokens) - 24
    if shared <= 0:
        return None
    suffixes = sum(p - shared for p in prompt_tokens)
    return (prefilled - suffixes) / shared


async def run_target(name, base, args, session=None):
    """Run the burst against one server; ``session`` reuses the caller's aiohttp session."""
    if session is None:
        async with aiohttp.ClientSession() as own:
            return await run_target(name, base, args, own)
    batch = prompts(args)
    model = args.model or await first_model(session, base, 30)
    before = await prefilled(session, base)
    t0 = time.monotonic()
    results = await asyncio.gather(*[one(session, base, model, p, args.timeout) for p in batch])
    wall = time.monotonic() - t0
    after = await prefilled(session, base)
    prompt_tokens = [r["prompt_tokens"] for r in results if r["prompt_tokens"]]
    shared = min(prompt_tokens) - 24 if prompt_tokens else None  # conservatively: what all share
    total = None if before is None or after is None else after - before
    if total is None and results and all(r["prompt_tokens"] and r["cached_tokens"] is not None for r in results):
        total = sum(r["prompt_tokens"] - r["cached_tokens"] for r in results)  # no counter: the usage's
    times = times_prefilled(total, prompt_tokens)
    ttfts = [r["ttft"] for r in results if r["ttft"] is not None]
    out = {"target": name, "requests": len(results), "completed": sum(r["ok"] for r in results),
           "shared_prefix_tokens": shared, "prefilled_tokens": total,
           "times_prefix_prefilled": times, "median_ttft_s": statistics.median(ttfts) if ttfts else None,
           "wall_s": wall, "prompt_tokens": prompt_tokens}
    print(f"{name}: {json.dumps({k: v for k, v in out.items() if k != 'prompt_tokens'})}",
          file=sys.stderr, flush=True)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.bench.shared_prefix", description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", action="append", required=True, metavar="NAME=BASE_URL")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prefix-tokens", type=int, default=4000)
    ap.add_argument("--model")
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args(argv)
    results = [asyncio.run(run_target(n, b.rstrip("/"), args))
               for n, _, b in (spec.partition("=") for spec in args.target)]
    print("| target | completed | prefix prefilled (times) | median TTFT (s) | wall (s) |\n|---|---:|---:|---:|---:|")
    for r in results:
        times = "-" if r["times_prefix_prefilled"] is None else f"{r['times_prefix_prefilled']:.2f}"
        ttft = "-" if r["median_ttft_s"] is None else f"{r['median_ttft_s']:.2f}"
        print(f"| {r['target']} | {r['completed']}/{r['requests']} | {times} | {ttft} | {r['wall_s']:.1f} |")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"args": vars(args), "results": results}, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
