"""Stream gaps while long prompts arrive: what a reader of a chat stream sees when other requests
start prefilling beside it.

Per round, per concurrency S, the targets take turns. On each target, S chat streams start
(``/v1/chat/completions``, ``--stream-tokens`` greedy tokens, ``ignore_eos``). Once every stream
has its first delta, ``--arrivals`` distinct prompts of about ``--arrival-tokens`` tokens arrive,
``--arrival-every`` seconds apart (``/v1/completions``, a few tokens each). A server that
prefills a newcomer in one long step stalls every stream for that step; one that interleaves
short prefill steps with decode rounds keeps them flowing. The gaps are the streams' inter-delta
times (tools/bench/smoothness.py: p50, p99, max, worst stream's p99), from each stream's first
delta to its last, pooled over the measured rounds; the arrivals' first-token times say what the
smoothness cost them.

A token without text (a special token the model writes after its ignored end of turn) sends no
content delta, so the content gap around it spans two ticks: the text's gap, not the server's.
``--token-events`` asks for ``logprobs``, which a server sends with every token it generates,
text or not, and reports the gaps between the chunks that carry tokens beside the content gaps.

    M=~/.cache/superfluid/models/SmolLM2-135M-Instruct.Q4_1.gguf
    LS=$(tools/bench/build_llama_server.sh)
    .venv/bin/python -m tools.bench.stream_gaps --target superfluid=superfluid:$M \\
        --target llama-server=llama-server:$M --streams 2,4,8 --rounds 3 --json gaps.json

Targets written ``NAME=KIND:MODEL.gguf`` are started by the tool (tools/bench/launch.py) with
``max(streams) + arrivals`` lanes of ``--context`` cells, and stopped when it ends; ``NAME=URL``
targets are servers already running. The first round is a warm-up unless ``--warmup 0``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import aiohttp

from . import launch, machine, smoothness
from .agents_chat import agent_prompt
from .client import first_model, sse_data
from .prompts import user_texts


async def _arrival(session, base: str, model: str, prompt: str, max_tokens: int, timeout: float) -> dict:
    """One long prompt, streamed so its first token is timed."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    sent = time.perf_counter()
    first, prompt_tokens = None, None
    async with session.post(f"{base}/v1/completions", json=body,
                            timeout=aiohttp.ClientTimeout(total=timeout)) as r:
        if r.status != 200:
            raise RuntimeError(f"{base}: /v1/completions answered {r.status}: {(await r.text())[:300]}")
        async for payload in sse_data(r.content):
            chunk = json.loads(payload)
            if first is None and any(c.get("text") for c in chunk.get("choices") or ()):
                first = time.perf_counter() - sent
            usage = chunk.get("usage")
            if isinstance(usage, dict):
                prompt_tokens = usage.get("prompt_tokens")
    return {"ttft_s": first, "prompt_tokens": prompt_tokens}


async def one_run(base: str, model: str | None, streams: int, tag: str, args) -> dict:
    """S streams, then the arrivals once every stream has started; every stream's gaps."""
    async with aiohttp.ClientSession() as session:
        model = model or await first_model(session, base, args.timeout)
        texts = user_texts(streams, tag=tag)
        started = [asyncio.Event() for _ in range(streams)]
        stream_tasks = [asyncio.create_task(_stream_with_start(session, base, model, texts[i], args, started[i]))
                        for i in range(streams)]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), args.timeout)
        arrivals = []
        for k in range(args.arrivals):
            if k:
                await asyncio.sleep(args.arrival_every)
            prompt = agent_prompt(abs(hash((tag, k))) % 100000, args.arrival_tokens)
            arrivals.append(asyncio.create_task(_arrival(session, base, model, prompt, args.arrival_reply,
                                                         args.timeout)))
        done = await asyncio.gather(*stream_tasks)
        arrived = await asyncio.gather(*arrivals)
    return {"streams": done, "arrivals": arrived}


async def _stream_with_start(session, base, model, text, args, started: asyncio.Event) -> dict:
    """One chat stream read to its end; ``started`` is set at its first content delta."""
    body = {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": args.stream_tokens,
            "ignore_eos": True, "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    if args.token_events:
        body["logprobs"] = True
    deltas: list[float] = []
    token_events: list[float] = []  # chunks that carry at least one token, with text or without
    tokens = None
    sent = time.perf_counter()
    try:
        async with session.post(f"{base}/v1/chat/completions", json=body,
                                timeout=aiohttp.ClientTimeout(total=args.timeout)) as r:
            if r.status != 200:
                raise RuntimeError(f"{base}: /v1/chat/completions answered {r.status}: {(await r.text())[:300]}")
            async for payload in sse_data(r.content):
                arrived = time.perf_counter()
                chunk = json.loads(payload)
                choices = chunk.get("choices") or ()
                if any((c.get("delta") or {}).get("content") for c in choices):
                    deltas.append(arrived)
                    started.set()
                if any(((c.get("logprobs") or {}).get("content")) for c in choices):
                    token_events.append(arrived)
                usage = chunk.get("usage")
                if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
                    tokens = usage["completion_tokens"]
    finally:
        started.set()  # a stream that failed must not hold the arrivals back
    return {"ttft_s": deltas[0] - sent if deltas else None, "gaps_s": smoothness.gaps(deltas),
            "deltas": len(deltas), "completion_tokens": tokens,
            "token_gaps_s": smoothness.gaps(token_events) if args.token_events else None,
            "token_events": len(token_events) if args.token_events else None}


def summarize(runs: list[dict]) -> dict:
    """The measured runs of one target at one concurrency: gaps pooled, arrivals' first tokens."""
    gap_lists = [s["gaps_s"] for run in runs for s in run["streams"]]
    gaps = smoothness.summarize(gap_lists)
    tokens = [s["completion_tokens"] / s["deltas"] for run in runs for s in run["streams"]
              if s["deltas"] and s["completion_tokens"]]
    ttfts = [a["ttft_s"] for run in runs for a in run["arrivals"] if a["ttft_s"] is not None]
    token_gaps = smoothness.summarize([s["token_gaps_s"] for run in runs for s in run["streams"]
                                       if s.get("token_gaps_s")])
    return {"gaps": gaps.to_json() if gaps else None,
            "token_gaps": token_gaps.to_json() if token_gaps else None,
            "tokens_per_delta": round(statistics.median(tokens), 2) if tokens else None,
            "arrival_ttft_median_s": round(statistics.median(ttfts), 2) if ttfts else None,
            "arrival_ttft_max_s": round(max(ttfts), 2) if ttfts else None}


def table(summary: dict[str, dict[int, dict]], concurrencies: list[int]) -> str:
    head = ("| target | streams | gap p50 (s) | p99 | max | worst stream p99 | between tokens: p99 / max | "
            "tokens/delta | arrivals' first token median / max (s) |")
    lines = [head, "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, by_c in summary.items():
        for c in concurrencies:
            row = by_c.get(c) or {}
            g, t = row.get("gaps") or {}, row.get("token_gaps") or {}
            cell = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
            lines.append(f"| {name} | {c} | {cell(g.get('p50'))} | {cell(g.get('p99'))} | {cell(g.get('max'))} | "
                         f"{cell(g.get('worst_stream_p99'))} | {cell(t.get('p99'))} / {cell(t.get('max'))} | "
                         f"{row.get('tokens_per_delta')} | "
                         f"{row.get('arrival_ttft_median_s')} / {row.get('arrival_ttft_max_s')} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.bench.stream_gaps", description=__doc__.split("\n")[0])
    ap.add_argument("--target", action="append", required=True, metavar="NAME=URL|NAME=KIND:MODEL.gguf")
    ap.add_argument("--streams", default="2,4,8", help="concurrent chat streams, comma-separated")
    ap.add_argument("--stream-tokens", type=int, default=200)
    ap.add_argument("--arrivals", type=int, default=3, help="long prompts arriving while the streams run")
    ap.add_argument("--arrival-tokens", type=int, default=2000, help="their approximate length")
    ap.add_argument("--arrival-every", type=float, default=1.0, help="seconds between two arrivals")
    ap.add_argument("--arrival-reply", type=int, default=4, help="tokens each arrival generates")
    ap.add_argument("--token-events", action="store_true",
                    help="ask for logprobs, sent with every token, and report the gaps between tokens too")
    ap.add_argument("--rounds", type=int, default=3, help="measured rounds")
    ap.add_argument("--warmup", type=int, default=1, help="rounds run first and discarded")
    launch.add_target_options(ap, timeout=900)
    ap.add_argument("--json", metavar="PATH", help="write every run here")
    args = ap.parse_args(argv)
    concurrencies = [int(c) for c in args.streams.split(",")]
    pairs = [tuple(t.split("=", 1)) for t in args.target]
    info = machine.describe()
    print(f"machine: {machine.line()}", file=sys.stderr)
    started = launch.start_all(pairs, max(concurrencies) + args.arrivals, args.context, Path(args.logs))
    bases = {name: base for name, base in pairs}
    for s in started:
        bases[s.name] = s.base
    runs: dict[str, dict[int, list[dict]]] = {name: {c: [] for c in concurrencies} for name, _ in pairs}
    try:
        for r in range(args.warmup + args.rounds):
            names = [n for n, _ in pairs]
            order = names[r % len(names):] + names[:r % len(names)]  # who goes first turns round by round
            for c in concurrencies:
                for name in order:
                    tag = f"g{r}.{c}.{name}.{time.time_ns() % 10**9}"
                    t0 = time.monotonic()
                    run = asyncio.run(one_run(bases[name], args.model, c, tag, args))
                    run.update(round=r, warmup=r < args.warmup, seconds=round(time.monotonic() - t0, 1))
                    runs[name][c].append(run)
                    row = summarize([run])
                    g, t = row["gaps"] or {}, row["token_gaps"]
                    between = f" (between tokens {t['max']:.3f})" if t else ""
                    print(f"round {r}{' (warm-up)' if r < args.warmup else ''} {name} streams={c}: gap p50 "
                          f"{g.get('p50', 0):.3f} p99 {g.get('p99', 0):.3f} max {g.get('max', 0):.3f} s{between}; "
                          f"arrivals' first token {row['arrival_ttft_median_s']} s ({run['seconds']} s)",
                          file=sys.stderr, flush=True)
    finally:
        launch.stop_all(started)
    summary = {name: {c: summarize([run for run in by_c[c] if not run["warmup"]]) for c in concurrencies}
               for name, by_c in runs.items()}
    print(table(summary, concurrencies))
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": info, "args": vars(args), "summary": summary,
                                               "runs": runs, "launched": [s.to_json() for s in started]},
                                              indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
