"""Admission wait while lanes decode: how long a request arriving at a random moment waits for the
tick in flight, and what the tick length costs the decoding lanes' throughput.

The spec sizes ticks at 50 ms (llama.cpp, MLX) while a lane is free, so a newcomer waits at most
about that long. Superfluid instead lets a *quiet* tick (nothing queued or prefilling, no client
reading before its reply ends) run to the busy target, and ends it at the engine's next step when
a request arrives (``--quiet-ticks``, on by default). This benchmark measures both on one server
command line each:

    M=~/.cache/superfluid/models/SmolLM2-135M-Instruct.Q4_1.gguf
    .venv/bin/superfluid serve --model $M --port 18090 --max-batch 4 &          # quiet ticks
    .venv/bin/python -m tools.bench.admission_wait --target quiet=http://127.0.0.1:18090
    .venv/bin/superfluid serve --model $M --port 18091 --max-batch 4 --no-quiet-ticks &
    .venv/bin/python -m tools.bench.admission_wait --target spec-50ms=http://127.0.0.1:18091

``--lanes`` background completions (not streamed, so the ticks are quiet where allowed) decode
``--reply-tokens`` tokens each with one lane left free; meanwhile ``--probes`` one-token requests
with a short prompt arrive one at a time after a random pause (uniform in 0..``--max-gap`` s). A
probe's first-token time is its wait to admission plus its own tiny prefill, which is the same on
both settings, so the difference between the settings is the admission wait. The throughput is
the background lanes' tokens over the time they took. Targets run one after the other.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time

import aiohttp

from .agents_chat import percentile
from .client import first_model, sse_data

BACKGROUND = ("<|im_start|>user\nWrite a long story about lane {i}, a ship that sails the northern "
              "sea.<|im_end|>\n<|im_start|>assistant\n")
PROBE = "<|im_start|>user\nSay yes.<|im_end|>\n<|im_start|>assistant\n"


async def _background(session, base, model, index, tokens, timeout):
    body = {"model": model, "prompt": BACKGROUND.format(i=index), "max_tokens": tokens,
            "temperature": 0, "ignore_eos": True}
    t0 = time.monotonic()
    async with session.post(f"{base}/v1/completions", json=body,
                            timeout=aiohttp.ClientTimeout(total=timeout)) as r:
        data = await r.json(content_type=None)
    return {"status": r.status, "seconds": time.monotonic() - t0,
            "tokens": (data.get("usage") or {}).get("completion_tokens", 0)}


async def _probe(session, base, model, timeout):
    body = {"model": model, "prompt": PROBE, "max_tokens": 1, "temperature": 0, "stream": True}
    t0 = time.monotonic()
    first = None
    async with session.post(f"{base}/v1/completions", json=body,
                            timeout=aiohttp.ClientTimeout(total=timeout)) as r:
        async for payload in sse_data(r.content):
            chunk = json.loads(payload)
            if first is None and any(c.get("text") is not None for c in chunk.get("choices") or ()):
                first = time.monotonic() - t0
    return first


async def run_target(name, base, args):
    rng = random.Random(args.seed)
    async with aiohttp.ClientSession() as session:
        model = args.model or await first_model(session, base, 30)
        idle = [await _probe(session, base, model, args.timeout) for _ in range(3)]  # warm, and the floor
        t0 = time.monotonic()
        lanes = [asyncio.create_task(_background(session, base, model, i, args.reply_tokens, args.timeout))
                 for i in range(args.lanes)]
        await asyncio.sleep(args.settle)  # the background prompts are prefilled: the lanes decode
        waits = []
        for _ in range(args.probes):
            await asyncio.sleep(rng.uniform(0, args.max_gap))
            if all(t.done() for t in lanes):
                break
            waits.append(await _probe(session, base, model, args.timeout))
        done = await asyncio.gather(*lanes)
    wall = max(r["seconds"] for r in done)
    waits = [w for w in waits if w is not None]
    out = {"target": name, "probes": len(waits), "idle_probe_s": statistics.median(idle),
           "probe_median_s": statistics.median(waits) if waits else None,
           "probe_p99_s": percentile(waits, 0.99) if waits else None,
           "probe_max_s": max(waits) if waits else None,
           "background_tokens": sum(r["tokens"] for r in done), "background_wall_s": wall,
           "throughput_tok_s": sum(r["tokens"] for r in done) / max(wall - 0.0, 1e-9),
           "statuses": sorted({r["status"] for r in done}), "waits": waits,
           "elapsed_s": time.monotonic() - t0}
    print(f"{name}: {out['probes']} probes, median {out['probe_median_s']}, p99 {out['probe_p99_s']}; "
          f"{out['throughput_tok_s']:.1f} tok/s", file=sys.stderr, flush=True)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.bench.admission_wait",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", action="append", required=True, metavar="NAME=BASE_URL")
    ap.add_argument("--lanes", type=int, default=3, help="background lanes decoding (leave one free)")
    ap.add_argument("--reply-tokens", type=int, default=1500)
    ap.add_argument("--probes", type=int, default=60)
    ap.add_argument("--max-gap", type=float, default=0.5, help="a probe's random pause before it, s")
    ap.add_argument("--settle", type=float, default=2.0, help="seconds before the first probe")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--model")
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args(argv)
    results = [asyncio.run(run_target(n, b.rstrip("/"), args))
               for n, _, b in (t.partition("=") for t in args.target)]
    print("| target | probes | idle probe (s) | wait median (s) | p99 (s) | max (s) | background tok/s |\n"
          "|---|---:|---:|---:|---:|---:|---:|")
    for r in results:
        cells = [f"{r[k]:.3f}" if r[k] is not None else "-"
                 for k in ("idle_probe_s", "probe_median_s", "probe_p99_s", "probe_max_s")]
        print(f"| {r['target']} | {r['probes']} | {' | '.join(cells)} | {r['throughput_tok_s']:.1f} |")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"args": vars(args), "results": results}, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
