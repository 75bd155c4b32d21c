"""Structured output against free output: decode throughput of chat replies held to a JSON
schema (``response_format`` json_schema) beside the same replies unconstrained, on one server,
at each concurrency. The ratio is what a constraint costs.

    python -m tools.bench.constrained --target superfluid=http://127.0.0.1:8080 --concurrency 1,8

Every reply has the same length (``max_tokens`` with ``ignore_eos``): the schema is an array of
at least 1,000 small objects, which no reply of that length can complete, so a constrained reply
is never cut short by its grammar. Free and constrained rounds alternate (free, json, free,
json, ...) so that drift on a noisy machine falls on both alike; the median of each is reported.
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

SCHEMA = {"type": "array", "minItems": 1000,
          "items": {"type": "object", "additionalProperties": False, "required": ["name", "score", "tags"],
                    "properties": {"name": {"type": "string", "maxLength": 24},
                                   "score": {"type": "integer"},
                                   "tags": {"type": "array", "maxItems": 3,
                                            "items": {"type": "string", "maxLength": 12}}}}}
JSON_FORMAT = {"type": "json_schema", "json_schema": {"name": "people", "schema": SCHEMA, "strict": True}}
PROMPTS = ["List the people in the chess club with a score and tags.",
           "Give me the players of the football team as JSON records.",
           "Write records for every member of the choir.",
           "Produce the staff list of the hospital ward.",
           "Enumerate the authors of the anthology with ratings.",
           "List the runners of the marathon with their results.",
           "Give the inventory of the library's reading room readers.",
           "Record the attendees of the conference dinner."]


async def reply(session, base: str, model: str, prompt: str, max_tokens: int, constrained: bool,
                timeout: float) -> tuple[int, float]:
    """One whole chat reply: (completion tokens, seconds)."""
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True}
    if constrained:
        body["response_format"] = JSON_FORMAT
    t0 = time.perf_counter()
    async with session.post(f"{base}/v1/chat/completions", json=body,
                            timeout=aiohttp.ClientTimeout(total=timeout)) as r:
        data = await r.json(content_type=None)
        if r.status != 200:
            raise RuntimeError(f"POST /v1/chat/completions: {r.status} {str(data)[:300]}")
    if constrained:
        text = data["choices"][0]["message"]["content"]
        if not text.lstrip().startswith("["):
            raise RuntimeError(f"a constrained reply is not the schema's array: {text[:120]!r}")
    return data["usage"]["completion_tokens"], time.perf_counter() - t0


async def round_(session, base, model, lanes: int, max_tokens: int, constrained: bool, timeout: float) -> float:
    """``lanes`` replies at once: generated tokens per second, all lanes together."""
    t0 = time.perf_counter()
    got = await asyncio.gather(*(reply(session, base, model, PROMPTS[i % len(PROMPTS)], max_tokens, constrained,
                                       timeout) for i in range(lanes)))
    return sum(n for n, _ in got) / (time.perf_counter() - t0)


async def measure(base: str, model: str | None, lanes_list: list[int], rounds: int, max_tokens: int,
                  timeout: float, quiet: bool) -> dict:
    out = {}
    async with aiohttp.ClientSession() as session:
        model = model or await first_model(session, base, timeout)
        for lanes in lanes_list:
            await round_(session, base, model, lanes, 16, True, timeout)  # warm up (the constraint's tokenizer)
            free, held = [], []
            for i in range(rounds):
                free.append(await round_(session, base, model, lanes, max_tokens, False, timeout))
                held.append(await round_(session, base, model, lanes, max_tokens, True, timeout))
                if not quiet:
                    print(f"  {lanes} lanes round {i + 1}: free {free[-1]:.1f} tok/s, json_schema {held[-1]:.1f} tok/s",
                          file=sys.stderr)
            f, h = statistics.median(free), statistics.median(held)
            out[lanes] = {"free_tok_s": f, "json_schema_tok_s": h, "ratio": h / f, "free_rounds": free,
                          "json_schema_rounds": held}
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", required=True, metavar="NAME=BASE_URL")
    p.add_argument("--model")
    p.add_argument("--concurrency", default="1,8", metavar="N,N,...")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--quiet", action="store_true")
    args = p.parse_args(argv)
    name, _, base = args.target.partition("=")
    lanes = [int(x) for x in args.concurrency.split(",")]
    result = asyncio.run(measure(base.rstrip("/"), args.model, lanes, args.rounds, args.max_tokens, args.timeout,
                                 args.quiet))
    print(f"{name}: json_schema against free output, {args.max_tokens}-token replies, median of {args.rounds}")
    print(f"{'lanes':>5} {'free tok/s':>11} {'json tok/s':>11} {'ratio':>6}")
    for n, r in result.items():
        print(f"{n:>5} {r['free_tok_s']:>11.1f} {r['json_schema_tok_s']:>11.1f} {r['ratio']:>6.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"target": name, "max_tokens": args.max_tokens, "rounds": args.rounds,
                       "results": {str(k): v for k, v in result.items()}}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
