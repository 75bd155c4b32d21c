"""Agreement in figures: how many greedy replies are the same text as the runtime's own generate,
and as another server's, alone and with other lanes decoding beside them.

At temperature 0 a server's reply equals the runtime's until two candidate tokens are close enough
for rounding to decide; batching changes the rounding (the kernels sum in another order over a
wider batch), so a reply can part ways at 4 or 8 lanes where it did not alone. This tool counts it.

Each target answers ``--prompts`` distinct raw-ChatML prompts (``/v1/completions``, temperature 0,
``--max-tokens``, stopping where the model stops) once per lane count L of ``--lanes``: the prompts
go in waves of L at once, so every reply of a wave decodes beside L - 1 others. Each lane count
gets its own prompt tags, so no prefix cached at another count answers a prefill. The reference is
llama-cpp-python's high-level ``Llama.create_completion`` on the same GGUF, each prompt alone, with
flash attention as the servers' ``auto`` sets it on a CPU (on), in a child process that dies with
the tool. The table counts identical texts per pair and lane count; the JSON keeps every reply.

    M=~/.cache/superfluid/models/SmolLM2-135M-Instruct.Q4_1.gguf
    .venv/bin/python -m tools.bench.agreement --target superfluid=superfluid:$M \\
        --target llama-server=llama-server:$M --reference $M --json agreement.json

Targets written ``NAME=KIND:MODEL.gguf`` are started by the tool (tools/bench/launch.py) with
``max(lanes)`` lanes and stopped when it ends; ``NAME=URL`` targets are servers already running.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import multiprocessing
import sys
from pathlib import Path

import aiohttp

from superfluid.core import lifeline

from . import launch, machine
from .client import first_model
from .prompts import completion_prompts

REFERENCE = "generate"  # the runtime's own high-level generate, as a row's name


def prompts_for(n: int, lanes: int) -> list[str]:
    """The prompts of one lane count: distinct from every other count's from their first token."""
    return completion_prompts(n, tag=f"agree L{lanes}")


async def _reply(http: aiohttp.ClientSession, base: str, model: str, prompt: str, max_tokens: int,
                 timeout: float) -> str:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    async with http.post(f"{base}/v1/completions", json=body, timeout=aiohttp.ClientTimeout(total=timeout)) as r:
        data = await r.json(content_type=None)
        if r.status != 200:
            raise RuntimeError(f"{base}: HTTP {r.status}: {str(data)[:300]}")
    return data["choices"][0]["text"]


async def target_replies(base: str, model: str | None, n: int, lane_counts: list[int], max_tokens: int,
                         timeout: float) -> dict[int, list[str]]:
    """{L: replies to ``prompts_for(n, L)``, sent in waves of L at once}."""
    async with aiohttp.ClientSession() as http:
        model = model or await first_model(http, base, timeout)
        out: dict[int, list[str]] = {}
        for lanes in lane_counts:
            prompts, replies = prompts_for(n, lanes), []
            for start in range(0, n, lanes):
                wave = prompts[start:start + lanes]
                replies += await asyncio.gather(*(_reply(http, base, model, p, max_tokens, timeout) for p in wave))
            out[lanes] = replies
    return out


def _generate(path: str, prompts: list[str], max_tokens: int, context: int) -> list[str]:
    """In the child: each prompt alone through llama-cpp-python's ``Llama.create_completion``."""
    from superfluid.plugins.llamacpp.extra_buffers import reference_llama

    llm = reference_llama(path, n_ctx=context, flash_attn=True, verbose=False, seed=0)
    try:
        return [llm.create_completion(p, max_tokens=max_tokens, temperature=0.0, repeat_penalty=1.0)
                ["choices"][0]["text"] for p in prompts]
    finally:
        llm.close()


def reference_replies(path: str, n: int, lane_counts: list[int], max_tokens: int,
                      context: int) -> dict[int, list[str]]:
    """The runtime's own replies to every lane count's prompts, computed in a spawned child (a
    crash in llama.cpp fails the run, not this process; the child dies with this process)."""
    prompts = [p for lanes in lane_counts for p in prompts_for(n, lanes)]
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"),
                                                initializer=lifeline.watch_parent) as pool:
        texts = pool.submit(_generate, path, prompts, max_tokens, context).result()
    return {lanes: texts[i * n:(i + 1) * n] for i, lanes in enumerate(lane_counts)}


def first_difference(a: str, b: str) -> int | None:
    """The first character where two replies differ; None where they are the same text."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def compare(replies: dict[str, dict[int, list[str]]], lane_counts: list[int]) -> list[dict]:
    """Rows of the table: every pair of sources (targets and the reference), per lane count, with
    where the differing replies part ways (characters in)."""
    names = list(replies)
    rows = []
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            cells = {}
            for lanes in lane_counts:
                pairs = list(zip(replies[a][lanes], replies[b][lanes]))
                diffs = [d for d in (first_difference(x, y) for x, y in pairs) if d is not None]
                cells[lanes] = {"identical": len(pairs) - len(diffs), "of": len(pairs),
                                "first_difference_chars": sorted(diffs)}
            rows.append({"a": a, "b": b, "cells": cells})
    return rows


def table(rows: list[dict], lane_counts: list[int]) -> str:
    head = "| replies identical | " + " | ".join("alone" if L == 1 else f"{L} lanes" for L in lane_counts) + " |"
    lines = [head, "|---|" + "---:|" * len(lane_counts)]
    for row in rows:
        cells = [f"{c['identical']}/{c['of']}" for c in (row["cells"][L] for L in lane_counts)]
        lines.append(f"| {row['a']} = {row['b']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.bench.agreement", description=__doc__.split("\n")[0])
    ap.add_argument("--target", action="append", required=True, metavar="NAME=URL|NAME=KIND:MODEL.gguf")
    ap.add_argument("--reference", metavar="MODEL.gguf", help="the GGUF llama-cpp-python's generate runs")
    ap.add_argument("--prompts", type=int, default=16, help="distinct prompts per lane count")
    ap.add_argument("--lanes", default="1,4,8", help="lanes decoding at once, comma-separated")
    ap.add_argument("--max-tokens", type=int, default=64)
    launch.add_target_options(ap, timeout=600, context_help="cells a lane (started targets, the reference)")
    ap.add_argument("--json", metavar="PATH", help="write every reply and the table here")
    args = ap.parse_args(argv)
    lane_counts = [int(L) for L in args.lanes.split(",")]
    if args.prompts < 1 or any(L < 1 for L in lane_counts):
        ap.error("--prompts and every --lanes value must be at least 1")
    pairs = [tuple(t.split("=", 1)) for t in args.target]
    print(f"machine: {machine.line()}", file=sys.stderr)
    replies: dict[str, dict[int, list[str]]] = {}
    if args.reference:
        print(f"{REFERENCE}: llama-cpp-python on {args.reference}", file=sys.stderr, flush=True)
        replies[REFERENCE] = reference_replies(args.reference, args.prompts, lane_counts, args.max_tokens,
                                               args.context)
    started = launch.start_all(pairs, max(lane_counts), args.context, Path(args.logs))
    bases = dict(pairs) | {s.name: s.base for s in started}
    try:
        for name, _ in pairs:
            print(f"{name}: {args.prompts} prompts at {args.lanes} lanes", file=sys.stderr, flush=True)
            replies[name] = asyncio.run(target_replies(bases[name], args.model, args.prompts, lane_counts,
                                                       args.max_tokens, args.timeout))
    finally:
        launch.stop_all(started)
    order = [n for n, _ in pairs] + ([REFERENCE] if args.reference else [])
    rows = compare({n: replies[n] for n in order}, lane_counts)
    print(table(rows, lane_counts))
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": machine.describe(), "args": vars(args), "rows": rows,
                                               "replies": replies,
                                               "launched": [s.to_json() for s in started]}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
