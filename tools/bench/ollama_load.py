"""Concurrency through Ollama's API beside the same load through chat completions, in one run:

    superfluid serve --max-batch 8
    python -m tools.bench.ollama_load --target http://127.0.0.1:8080 --clients 8 --tokens 64

Each round sends ``--clients`` requests at once (distinct prompts, greedy, at most ``--tokens``
each, so both APIs generate the same tokens) through one API; the rounds alternate between ``/api/chat`` and
``/v1/chat/completions`` so drift falls on both alike. Reported per API: the generated tokens per
second over the round's wall time (mean over rounds) and the most lanes ``/slots`` showed busy at
once. Ollama itself runs one request at a time unless ``OLLAMA_NUM_PARALLEL`` says otherwise.
Run it on a quiet machine.
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


def bodies(model: str, i: int, tokens: int) -> dict[str, tuple[str, dict]]:
    messages = [{"role": "user", "content": f"Tell me a story about the number {i}."}]
    return {
        "ollama": ("/api/chat", {"model": model, "messages": messages, "stream": False,
                                 "options": {"temperature": 0, "num_predict": tokens}}),
        "openai": ("/v1/chat/completions", {"model": model, "messages": messages, "max_tokens": tokens,
                                            "temperature": 0}),
    }


def generated(api: str, reply: dict) -> int:
    return reply["eval_count"] if api == "ollama" else reply["usage"]["completion_tokens"]


async def _busiest(session, base: str, stop: asyncio.Event) -> int:
    most = 0
    while not stop.is_set():
        async with session.get(base + "/slots") as resp:
            models = (await resp.json())["models"]
        most = max(most, max(sum(s["state"] != "free" for s in m["slots"]) for m in models.values()))
        await asyncio.sleep(0.05)
    return most


async def _round(session, base: str, model: str, api: str, clients: int, tokens: int) -> tuple[float, int]:
    async def one(i):
        path, body = bodies(model, i, tokens)[api]
        async with session.post(base + path, json=body) as resp:
            if resp.status != 200:
                raise RuntimeError(f"{path}: {resp.status} {(await resp.read())[:300]!r}")
            return generated(api, await resp.json())

    stop = asyncio.Event()
    watcher = asyncio.create_task(_busiest(session, base, stop))
    t0 = time.perf_counter()
    counts = await asyncio.gather(*(one(i) for i in range(clients)))
    seconds = time.perf_counter() - t0
    stop.set()
    return sum(counts) / seconds, await watcher


async def main_async(args) -> dict:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        model = args.model or await first_model(session, args.target, 60)
        await _round(session, args.target, model, "openai", args.clients, 8)  # warm-up
        rates: dict[str, list[float]] = {"ollama": [], "openai": []}
        lanes: dict[str, int] = {"ollama": 0, "openai": 0}
        for _ in range(args.rounds):
            for api in ("ollama", "openai"):
                rate, busiest = await _round(session, args.target, model, api, args.clients, args.tokens)
                rates[api].append(rate)
                lanes[api] = max(lanes[api], busiest)
    out = {"machine": machine.describe(), "model": model, "clients": args.clients, "tokens": args.tokens}
    for api in rates:
        out[api] = {"tokens_per_s": round(sum(rates[api]) / len(rates[api]), 1), "most_lanes_busy": lanes[api]}
    out["ratio_ollama_to_openai"] = round(out["ollama"]["tokens_per_s"] / out["openai"]["tokens_per_s"], 3)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="http://127.0.0.1:8080")
    ap.add_argument("--model")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    print(json.dumps(asyncio.run(main_async(args)), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
