"""Throughput of LoRA adapters mixed across requests against one adapter, on a running server
(``python -m tools.bench.lora_mix --url http://127.0.0.1:8080 --model smollm2 --adapters a,b``).

Each round sends ``--requests`` concurrent completions (greedy, ``--tokens`` each, end of text
ignored, distinct prompts so no prefix is shared) twice: all under the first adapter (*one*),
then spread across the base model and every adapter in turn (*mixed*). Rounds alternate, so the
machine's drift falls on both alike. Reported per mode: generated tokens per second of wall time
(the median round) and the rounds' spread. On an engine that runs one adapter set per tick
(llama.cpp, MLX) the mixed requests take turns by group, so *mixed* shows what grouping costs."""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import time
import urllib.request
from statistics import median


def _complete(url: str, model: str, prompt: str, tokens: int) -> int:
    body = {"model": model, "prompt": prompt, "max_tokens": tokens, "temperature": 0, "ignore_eos": True}
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=1800) as r:
        return json.loads(r.read())["usage"]["completion_tokens"]


def _round(url: str, models: list[str], tokens: int, salt: int) -> float:
    prompts = [f"Request {salt}-{i}: write a long story about the number {i * 7 + salt}." for i in range(len(models))]
    start = time.perf_counter()
    with cf.ThreadPoolExecutor(len(models)) as pool:
        made = sum(pool.map(lambda mp: _complete(url, mp[0], mp[1], tokens), zip(models, prompts)))
    return made / (time.perf_counter() - start)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", required=True)
    ap.add_argument("--model", required=True, help="the base model's name")
    ap.add_argument("--adapters", required=True, help="adapter names, comma-separated (the first is 'one')")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    names = [a for a in args.adapters.split(",") if a]
    one = [f"{args.model}:{names[0]}"] * args.requests
    pool = [args.model] + [f"{args.model}:{a}" for a in names]
    mixed = [pool[i % len(pool)] for i in range(args.requests)]
    rates: dict[str, list[float]] = {"one": [], "mixed": []}
    _round(args.url, one[:1], 4, -1)  # warm up
    for r in range(args.rounds):
        rates["one"].append(_round(args.url, one, args.tokens, 2 * r))
        rates["mixed"].append(_round(args.url, mixed, args.tokens, 2 * r + 1))
    report = {mode: {"tok_s_median": round(median(v), 2), "tok_s_min": round(min(v), 2),
                     "tok_s_max": round(max(v), 2)} for mode, v in rates.items()}
    report["mixed_over_one"] = round(report["mixed"]["tok_s_median"] / report["one"]["tok_s_median"], 3)
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
