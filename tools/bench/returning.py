"""Returning conversations: a second turn's first-token time by where its prefix came from, the
spare KV buffers in the pool, host memory, or nowhere (cold).

It starts nothing: it drives a running superfluid server. Start one per layout, then run it:

    superfluid serve --model MODEL.gguf --max-batch 2 --port 8080    # 2 lanes, 4 KV buffers
    python -m tools.bench.returning --url http://127.0.0.1:8080 --conversations 6

    superfluid serve --model MODEL.gguf --max-batch 8 --port 8080    # 8 lanes, 10 KV buffers
    python -m tools.bench.returning --url http://127.0.0.1:8080 --conversations 14

The method, one request at a time (nothing else should use the server meanwhile):

1. ``--conversations`` N conversations send a first turn each: a distinct user message of about
   ``--prompt-tokens`` tokens, greedy, a ``--reply-tokens`` reply.
2. Their second turns (the first turn, its reply and a short question) come back most recent
   conversation first. The pool keeps a finished conversation's KV in its buffer, and with
   per-sequence buffers there are max-batch + 2 of them: the most recent conversations are
   seeded there in place; older ones were pushed out to host memory (``--host-cache-mb``) and
   are seeded from it. Choose N above max-batch + 2 to see both.
3. Cold: each second turn is sent once more with ``cache_prompt: false``, the same prompt
   prefilled whole (the cache is not asked, so the other tiers cannot answer it).

A second turn is labelled by the server's counters read around it:
``superfluid_prefix_cache_host_hits_total`` rose: ``host``; else
``superfluid_prefix_cache_hits_total`` rose: ``pool``; else ``miss`` (its prefix was lost, a
cold prefill). The KV bytes the engine allocated come from ``/health`` (``kv_bytes``, with the
cells and sequences of the layout), as the llama.cpp worker reports them at start.

``--json FILE`` writes every measurement.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time

import aiohttp

from .client import first_model, sse_data

SENTENCE = ("Conversation {c}, note {i}: the incident review covers the cache tier, the retry budget, "
            "the failover drill and the on-call handover for this quarter. ")
QUESTION = "Thanks. Which two notes matter most, in one sentence?"
COUNTERS = ("superfluid_prefix_cache_hits_total", "superfluid_prefix_cache_host_hits_total",
            "superfluid_prefix_cache_hit_tokens_total")


def first_turn(conv: int, approx_tokens: int) -> list[dict]:
    """A distinct first turn of about ``approx_tokens`` tokens (a sentence is about 30 tokens)."""
    body = "".join(SENTENCE.format(c=conv, i=i) for i in range(max(1, approx_tokens // 30)))
    return [{"role": "user", "content": f"Conversation {conv}. Read these notes.\n{body}\nSummarize them briefly."}]


async def counters(session: aiohttp.ClientSession, base: str, model: str) -> dict[str, float]:
    """The prefix-cache counters of ``model`` on /metrics (0 for one not yet exported)."""
    async with session.get(f"{base}/metrics", timeout=aiohttp.ClientTimeout(total=30)) as r:
        text = await r.text()
    out = dict.fromkeys(COUNTERS, 0.0)
    for line in text.splitlines():
        name, _, rest = line.partition("{")
        if name in out and f'model="{model}"' in rest:
            out[name] += float(line.rsplit(" ", 1)[1])
    return out


async def chat(session, base: str, model: str, messages: list[dict], max_tokens: int, *, cache: bool = True,
               timeout: float = 600.0) -> dict:
    """One streamed greedy chat turn: its first-token time, reply and usage."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    if not cache:
        body["cache_prompt"] = False
    t0 = time.monotonic()
    first, parts, usage = None, [], {}
    async with session.post(f"{base}/v1/chat/completions", json=body,
                            timeout=aiohttp.ClientTimeout(total=timeout)) as r:
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {(await r.text())[:300]}")
        async for payload in sse_data(r.content):
            chunk = json.loads(payload)
            for choice in chunk.get("choices") or ():
                text = (choice.get("delta") or {}).get("content")
                if text:
                    first = first if first is not None else time.monotonic() - t0
                    parts.append(text)
            usage = chunk.get("usage") or usage
    return {"ttft": first, "reply": "".join(parts), "prompt_tokens": usage.get("prompt_tokens"),
            "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens")}


def label(before: dict, after: dict) -> str:
    if after["superfluid_prefix_cache_host_hits_total"] > before["superfluid_prefix_cache_host_hits_total"]:
        return "host"
    if after["superfluid_prefix_cache_hits_total"] > before["superfluid_prefix_cache_hits_total"]:
        return "pool"
    return "miss"


async def layout(session, base: str, model: str) -> dict:
    """The engine's KV layout from /health: cells, sequences, shared pool or not, bytes."""
    async with session.get(f"{base}/health", timeout=aiohttp.ClientTimeout(total=30)) as r:
        health = await r.json(content_type=None)
    info = (health.get("models") or {}).get(model) or {}
    return {k: info.get(k) for k in ("n_ctx", "n_seq_max", "kv_unified", "bytes_per_cell", "kv_bytes")}


async def run(args) -> dict:
    base = args.url.rstrip("/")
    async with aiohttp.ClientSession() as session:
        model = args.model or await first_model(session, base, 30)
        kv = await layout(session, base, model)
        convs = [first_turn(c, args.prompt_tokens) for c in range(args.conversations)]
        firsts = []
        for c, messages in enumerate(convs):
            out = await chat(session, base, model, messages, args.reply_tokens)
            firsts.append(out)
            print(f"first turn {c}: {out['prompt_tokens']} prompt tokens, first token {out['ttft']:.3f} s",
                  file=sys.stderr)
        seconds = [convs[c] + [{"role": "assistant", "content": firsts[c]["reply"]},
                               {"role": "user", "content": QUESTION}] for c in range(args.conversations)]
        returns = []
        for c in reversed(range(args.conversations)):  # the most recent conversation first
            before = await counters(session, base, model)
            out = await chat(session, base, model, seconds[c], args.reply_tokens)
            out.update(conversation=c, source=label(before, await counters(session, base, model)))
            returns.append(out)
            print(f"second turn {c}: {out['source']}, {out['cached_tokens']} of {out['prompt_tokens']} cached, "
                  f"first token {out['ttft']:.3f} s", file=sys.stderr)
        for c in reversed(range(args.conversations)):
            out = await chat(session, base, model, seconds[c], args.reply_tokens, cache=False)
            out.update(conversation=c, source="cold")
            returns.append(out)
    return {"model": model, "url": base, "kv": kv, "conversations": args.conversations,
            "prompt_tokens": args.prompt_tokens, "first_turns": firsts, "second_turns": returns}


def report(result: dict) -> str:
    kv = result["kv"]
    mib = f"{kv['kv_bytes'] / 2**20:.1f} MiB" if kv.get("kv_bytes") else "? (no kv_bytes on /health)"
    lines = [f"model {result['model']} at {result['url']}: KV {mib}, {kv.get('n_ctx')} cells, "
             f"{kv.get('n_seq_max')} sequences, {'shared pool' if kv.get('kv_unified') else 'per-sequence buffers'}",
             "", f"{'conversation':>12}  {'source':6}  {'cached':>7}  {'prompt':>7}  {'first token s':>13}"]
    for r in result["second_turns"]:
        ttft = f"{r['ttft']:.3f}" if r["ttft"] is not None else "-"
        lines.append(f"{r['conversation']:>12}  {r['source']:6}  {r['cached_tokens'] or 0:>7}  "
                     f"{r['prompt_tokens'] or 0:>7}  {ttft:>13}")
    lines.append("")
    for source in ("pool", "host", "miss", "cold"):
        times = [r["ttft"] for r in result["second_turns"] if r["source"] == source and r["ttft"] is not None]
        if times:
            lines.append(f"{source:6} {len(times):>3} turns: median first token {statistics.median(times):.3f} s "
                         f"(min {min(times):.3f}, max {max(times):.3f})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", required=True, help="a running superfluid server, e.g. http://127.0.0.1:8080")
    parser.add_argument("--model", default=None, help="the model to ask (default: the first /v1/models lists)")
    parser.add_argument("--conversations", type=int, default=6)
    parser.add_argument("--prompt-tokens", type=int, default=1500, help="about this many tokens a first turn")
    parser.add_argument("--reply-tokens", type=int, default=32)
    parser.add_argument("--json", default=None, metavar="FILE", help="write every measurement here")
    args = parser.parse_args(argv)
    result = asyncio.run(run(args))
    print(report(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
