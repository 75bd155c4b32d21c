"""What a front end costs: the same one-token reply asked through each API's route, timed by the
client, against chat completions in the same run.

    python -m tools.bench.routes --target http://127.0.0.1:8080 --requests 300

Every request carries the same short conversation and asks for one greedy token, so the model's
work is the same whatever the route (the prefix cache serves the prompt after the first): what
differs is the front end's own work (parsing and validating the body, mapping it onto a chat,
writing the reply in its API's shape). Requests go one at a time over one keep-alive connection
per route, the routes interleaved within each round, so drift on the machine (another job, a
warm cache) falls on every route alike. Reported per route and mode (whole, streamed): p50 and
p99 of the latency, and their difference from chat completions'. Run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time

import aiohttp

from . import machine
from .client import first_model

QUESTION = "Name one colour of the rainbow."
SYSTEM = "You are a terse assistant."


def bodies(model: str, stream: bool) -> dict[str, tuple[str, dict]]:
    """route name -> (path, body): the same conversation in each API's words."""
    return {
        "chat": ("/v1/chat/completions", {
            "model": model, "max_tokens": 1, "temperature": 0, "stream": stream,
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]}),
        "messages": ("/v1/messages", {
            "model": model, "max_tokens": 1, "temperature": 0, "stream": stream, "system": SYSTEM,
            "messages": [{"role": "user", "content": QUESTION}]}),
        "responses": ("/v1/responses", {
            "model": model, "max_output_tokens": 1, "temperature": 0, "stream": stream, "store": False,
            "instructions": SYSTEM, "input": QUESTION}),
    }


async def _once(session: aiohttp.ClientSession, url: str, body: dict) -> float:
    t0 = time.perf_counter()
    async with session.post(url, json=body) as resp:
        data = await resp.read()  # a stream is read to its end: the reply is complete
        if resp.status != 200:
            raise RuntimeError(f"{url}: {resp.status} {data[:300]!r}")
    return time.perf_counter() - t0


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


async def measure(base: str, model: str | None, requests: int, warmup: int, stream: bool) -> dict:
    timeout = aiohttp.ClientTimeout(total=120)
    sessions = {}
    try:
        async with aiohttp.ClientSession(timeout=timeout) as probe:
            model = model or await first_model(probe, base, 30)
        routes = bodies(model, stream)
        # one keep-alive connection per route: connection setup is not a route's cost
        sessions = {name: aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=1))
                    for name in routes}
        times: dict[str, list[float]] = {name: [] for name in routes}
        for i in range(warmup + requests):
            for name, (path, body) in routes.items():
                seconds = await _once(sessions[name], base + path, body)
                if i >= warmup:
                    times[name].append(seconds)
    finally:
        for s in sessions.values():
            await s.close()
    out = {}
    chat50, chat99 = percentile(times["chat"], 0.5), percentile(times["chat"], 0.99)
    for name, values in times.items():
        p50, p99 = percentile(values, 0.5), percentile(values, 0.99)
        out[name] = {"p50_ms": p50 * 1000, "p99_ms": p99 * 1000,
                     "p50_over_chat_ms": (p50 - chat50) * 1000, "p99_over_chat_ms": (p99 - chat99) * 1000}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.bench.routes", description=__doc__.split("\n\n")[0])
    p.add_argument("--target", required=True, metavar="BASE_URL", help="a superfluid serve, e.g. http://127.0.0.1:8080")
    p.add_argument("--model", help="model field (default: the first of GET /v1/models)")
    p.add_argument("--requests", type=int, default=300, help="measured requests per route and mode (default 300)")
    p.add_argument("--warmup", type=int, default=20, help="requests per route discarded first (default 20)")
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    args = p.parse_args(argv)
    results = {}
    for stream in (False, True):
        mode = "stream" if stream else "whole"
        results[mode] = asyncio.run(measure(args.target.rstrip("/"), args.model, args.requests, args.warmup, stream))
    print(f"# route overhead against chat completions, {args.requests} requests each; {machine.line()}")
    print(f"{'mode':7} {'route':10} {'p50 ms':>8} {'p99 ms':>8} {'p50 +ms':>8} {'p99 +ms':>8}")
    for mode, routes in results.items():
        for name, r in routes.items():
            print(f"{mode:7} {name:10} {r['p50_ms']:8.2f} {r['p99_ms']:8.2f} "
                  f"{r['p50_over_chat_ms']:+8.2f} {r['p99_over_chat_ms']:+8.2f}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"machine": machine.describe(), "requests": args.requests, "results": results}, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
