"""What reading replies in a family's format costs: streamed chat replies with tools offered
(so every delta goes through the model's tool-call reader) against the very same prompt sent as
a raw completion (no reading at all), on one server, at each concurrency.

    python -m tools.bench.parsing --target superfluid=http://127.0.0.1:8080 --concurrency 1,8

Both arms generate the same tokens: the completion's prompt is the chat's own prompt as
``/apply-template`` renders it (tools included), replies are greedy with ``ignore_eos`` and the
same ``max_tokens``. So the ratio is what the reader costs the server (in the daemon's process,
beside the HTTP work), nothing else. Rounds alternate (chat, completion, chat, ...) so drift on a
noisy machine falls on both alike; the median of each is reported. Start the server with the
family's template (``--chat-template-file``) to measure that family's reader."""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time

import aiohttp

from .client import first_model, sse_data

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "search_files", "description": "Search the repository for a pattern",
        "parameters": {"type": "object", "properties": {"pattern": {"type": "string"}, "limit": {"type": "integer"}},
                       "required": ["pattern"]}}}]
PROMPTS = ["Tell me about the weather patterns of Paris in spring.", "Explain how a hash map works.",
           "Write a short story about a lighthouse keeper.", "Describe the rules of chess briefly.",
           "What should I pack for a hiking trip?", "Summarise the history of the printing press.",
           "Give advice on learning a new language.", "Describe how bread is made."]


async def _post_stream(session, url: str, body: dict, timeout: float) -> int:
    """Stream one reply; the number of chunks that carried something (content, reasoning, calls)."""
    chunks = 0
    async with session.post(url, json=body, timeout=aiohttp.ClientTimeout(total=timeout)) as r:
        if r.status != 200:
            raise RuntimeError(f"POST {url}: {r.status} {(await r.text())[:300]}")
        async for payload in sse_data(r.content):
            chunks += 1
    return chunks


async def chat_prompt(session, base: str, model: str, prompt: str, timeout: float) -> str:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "tools": TOOLS}
    async with session.post(f"{base}/apply-template", json=body, timeout=aiohttp.ClientTimeout(total=timeout)) as r:
        data = await r.json(content_type=None)
        if r.status != 200:
            raise RuntimeError(f"POST /apply-template: {r.status} {str(data)[:300]}")
    return data["prompt"]


async def round_(session, base, model, lanes: int, max_tokens: int, rendered: list[str] | None,
                 timeout: float) -> float:
    """``lanes`` streamed replies at once (chats with tools, or ``rendered`` prompts as raw
    completions): generated tokens per second, all lanes together."""
    common = {"model": model, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    t0 = time.perf_counter()
    jobs = []
    for i in range(lanes):
        if rendered is None:
            body = {**common, "messages": [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}], "tools": TOOLS}
            jobs.append(_post_stream(session, f"{base}/v1/chat/completions", body, timeout))
        else:
            body = {**common, "prompt": rendered[i % len(rendered)]}
            jobs.append(_post_stream(session, f"{base}/v1/completions", body, timeout))
    await asyncio.gather(*jobs)
    return lanes * max_tokens / (time.perf_counter() - t0)


async def measure(base: str, model: str | None, lanes_list: list[int], rounds: int, max_tokens: int,
                  timeout: float, quiet: bool) -> dict:
    out = {}
    async with aiohttp.ClientSession() as session:
        model = model or await first_model(session, base, timeout)
        rendered = [await chat_prompt(session, base, model, p, timeout) for p in PROMPTS]
        for lanes in lanes_list:
            await round_(session, base, model, lanes, 8, None, timeout)  # warm up: prompts cached alike
            await round_(session, base, model, lanes, 8, rendered, timeout)
            read, raw = [], []
            for i in range(rounds):
                read.append(await round_(session, base, model, lanes, max_tokens, None, timeout))
                raw.append(await round_(session, base, model, lanes, max_tokens, rendered, timeout))
                if not quiet:
                    print(f"  {lanes} lanes round {i + 1}: chat with tools {read[-1]:.1f} tok/s, "
                          f"raw completion {raw[-1]:.1f} tok/s", file=sys.stderr)
            a, b = statistics.median(read), statistics.median(raw)
            out[lanes] = {"tools_tok_s": a, "raw_tok_s": b, "ratio": a / b, "tools_rounds": read, "raw_rounds": raw}
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", required=True, metavar="NAME=BASE_URL")
    p.add_argument("--model")
    p.add_argument("--concurrency", default="1,8", metavar="N,N,...")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--quiet", action="store_true")
    args = p.parse_args(argv)
    name, _, base = args.target.partition("=")
    lanes = [int(x) for x in args.concurrency.split(",")]
    result = asyncio.run(measure(base.rstrip("/"), args.model, lanes, args.rounds, args.max_tokens, args.timeout,
                                 args.quiet))
    print(f"{name}: streamed chats with tools (read by the family's reader) against the same prompts as raw "
          f"completions, {args.max_tokens}-token replies, median of {args.rounds}")
    print(f"{'lanes':>5} {'tools tok/s':>12} {'raw tok/s':>10} {'ratio':>6}")
    for n, r in result.items():
        print(f"{n:>5} {r['tools_tok_s']:>12.1f} {r['raw_tok_s']:>10.1f} {r['ratio']:>6.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"target": name, "max_tokens": args.max_tokens, "rounds": args.rounds,
                       "results": {str(k): v for k, v in result.items()}}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
