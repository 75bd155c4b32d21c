"""Agents + interactive chat: eight agents prefilling long prompts, then one short chat in the
interactive class. Reports the chat's time to first token on each target, and the agents' own
first tokens (mean and p90) against what serving them one at a time would give.

The one-at-a-time reference comes from a lone agent on the same target (a prompt of the same
length no other request shares), sent once before the burst and once after it: the mean of their
first-token times gives the prefill rate, and serving the burst's prompts one after another,
shortest first, at that rate gives each agent's first token at the sum of the prompts before it
and its own. For equal prompts that is the lone time × (n+1)/2 on average. Two lone agents, one
either side, because a 2-core cloud machine's speed drifts: the same lone prompt took 28 s and
36 s on one server twenty minutes apart, and a reference taken at one end of a four-minute burst
moved the ratio by that much. The ratio against the lone agent before the burst alone is
reported too. ``--no-reference`` skips both lone agents.

    python -m tools.bench.agents_chat --target superfluid=http://127.0.0.1:8080 \\
        --target llama-server=http://127.0.0.1:8081 --prompt-tokens 6000

Targets run one after the other (the workload saturates the machine). The chat is sent once
every agent request is in flight (after ``--chat-delay`` seconds) with ``x-superfluid-qos:
interactive``; servers that do not know the header ignore it.

More agents than lanes, with short prompts and long replies, is the queue-aging shape: the
queued agents age while the lanes decode, and the chat must still preempt one of them:

    python -m tools.bench.agents_chat --target superfluid=http://127.0.0.1:8080 \\
        --agents 14 --prompt-tokens 40 --agent-tokens 400 --ignore-eos --chat-delay 12
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time

import aiohttp

from .client import first_model, sse_data

FILLER = ("The quick brown fox jumps over the lazy dog while the committee reviews section {i} "
          "of the report on distributed systems, caching strategies and scheduling policies. ")


def agent_prompt(index: int, approx_tokens: int) -> str:
    """A distinct long prompt of about ``approx_tokens`` tokens: a sentence is about 34 tokens with
    SmolLM2's tokenizer (measured: 3000 asked gives 2.8k-3.0k tokens, 6000 gives 5.7k-6.0k)."""
    body = "".join(FILLER.format(i=f"{index}.{k}") for k in range(max(1, approx_tokens // 34)))
    return (f"<|im_start|>user\nAgent {index}: summarize the following notes.\n{body}<|im_end|>\n"
            "<|im_start|>assistant\n")


async def _agent(session, base, model, prompt, max_tokens, timeout, ignore_eos=False):
    """One agent request, streamed so its first token is timed; the usage chunk gives its prompt
    length (servers that send none leave it None)."""
    t0 = time.monotonic()
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    if ignore_eos:  # llama.cpp's extension: the reply runs its whole length
        body["ignore_eos"] = True
    first = prompt_tokens = None
    async with session.post(f"{base}/v1/completions", json=body,
            headers={"x-superfluid-qos": "agent"}, timeout=aiohttp.ClientTimeout(total=timeout)) as r:
        if r.status != 200:
            return {"ok": False, "seconds": time.monotonic() - t0, "ttft": None, "prompt_tokens": None,
                    "error": (await r.text())[:300]}
        async for payload in sse_data(r.content):
            chunk = json.loads(payload)
            if first is None and any(c.get("text") for c in chunk.get("choices") or ()):
                first = time.monotonic() - t0
            prompt_tokens = (chunk.get("usage") or {}).get("prompt_tokens", prompt_tokens)
    return {"ok": first is not None, "seconds": time.monotonic() - t0, "ttft": first,
            "prompt_tokens": prompt_tokens, "error": None if first is not None else "no token came"}


def percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) by linear interpolation between the sorted values."""
    xs = sorted(values)
    pos = (len(xs) - 1) * q
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def one_at_a_time(prompt_tokens: list[int], lone_tokens: int, lone_ttft: float) -> list[float]:
    """First-token times if the prompts were prefilled one after another, shortest first, at the
    lone agent's rate (its prompt tokens over its first-token time)."""
    per_token = lone_ttft / max(lone_tokens, 1)
    done, out = 0, []
    for n in sorted(prompt_tokens):
        done += n
        out.append(done * per_token)
    return out


def agent_summary(results: list[dict], lone: dict | None, lone_after: dict | None = None) -> dict:
    """The burst's agent first tokens (mean, p90, each) and, with lone agents, the reference: from
    the mean of the lone agents' first-token times (both, where the one after the burst came),
    and from the one before alone (``*_before``)."""
    firsts = [r["ttft"] for r in results if r["ttft"] is not None]
    out: dict = {"agent_ttfts_s": sorted(firsts)}
    if not firsts:
        return out
    out["agent_ttft_mean_s"] = sum(firsts) / len(firsts)
    out["agent_ttft_p90_s"] = percentile(firsts, 0.9)
    tokens = [r["prompt_tokens"] for r in results]
    if not (lone and lone.get("ttft") and lone.get("prompt_tokens") and all(tokens)):
        return out
    out["lone_ttft_s"], out["lone_prompt_tokens"] = lone["ttft"], lone["prompt_tokens"]
    lones = [lone]
    if lone_after and lone_after.get("ttft") and lone_after.get("prompt_tokens"):
        out["lone_after_ttft_s"] = lone_after["ttft"]
        lones.append(lone_after)
    for suffix, used in (("", lones), ("_before", [lone])):
        rate = sum(l["ttft"] / l["prompt_tokens"] for l in used) / len(used)  # seconds a prompt token
        ref = one_at_a_time(tokens, 1, rate)
        out[f"reference_mean{suffix}_s"] = sum(ref) / len(ref)
        out[f"reference_p90{suffix}_s"] = percentile(ref, 0.9)
        out[f"mean_over_reference{suffix}"] = out["agent_ttft_mean_s"] / out[f"reference_mean{suffix}_s"]
        out[f"p90_over_reference{suffix}"] = out["agent_ttft_p90_s"] / out[f"reference_p90{suffix}_s"]
    return out


async def _chat(session, base, model, timeout):
    t0 = time.monotonic()
    ttft = None
    async with session.post(f"{base}/v1/chat/completions", json={
            "model": model, "messages": [{"role": "user", "content": "Say hello in five words."}],
            "max_tokens": 16, "temperature": 0, "stream": True},
            headers={"x-superfluid-qos": "interactive"}, timeout=aiohttp.ClientTimeout(total=timeout)) as r:
        async for raw in r.content:
            line = raw.decode(errors="replace").strip()
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            delta = (chunk.get("choices") or [{}])[0].get("delta", {})
            if ttft is None and (delta.get("content") or delta.get("reasoning_content")):
                ttft = time.monotonic() - t0
    return {"ttft": ttft, "seconds": time.monotonic() - t0}


async def run_target(name, base, args):
    async with aiohttp.ClientSession() as session:
        model = args.model or await first_model(session, base, 30)
        lone = None
        if not args.no_reference:  # same length as the burst's prompts (index n), shared by none
            lone = await _agent(session, base, model, agent_prompt(args.agents, args.prompt_tokens),
                                args.agent_tokens, args.timeout, args.ignore_eos)
            print(f"{name}: lone agent's first token {lone['ttft']} s for {lone['prompt_tokens']} "
                  "prompt tokens", file=sys.stderr, flush=True)
        prompts = [agent_prompt(i, args.prompt_tokens) for i in range(args.agents)]
        t0 = time.monotonic()
        agents = [asyncio.create_task(_agent(session, base, model, p, args.agent_tokens, args.timeout,
                                             args.ignore_eos))
                  for p in prompts]
        await asyncio.sleep(args.chat_delay)
        chat = await _chat(session, base, model, args.timeout)
        results = await asyncio.gather(*agents)
        wall = time.monotonic() - t0
        lone_after = None
        if not args.no_reference:  # the machine's speed drifts: a second reference after the burst
            lone_after = await _agent(session, base, model, agent_prompt(args.agents + 1, args.prompt_tokens),
                                      args.agent_tokens, args.timeout, args.ignore_eos)
            print(f"{name}: lone agent after the burst: first token {lone_after['ttft']} s",
                  file=sys.stderr, flush=True)
    out = {"target": name, "base": base, "chat_ttft_s": chat["ttft"], "chat_total_s": chat["seconds"],
           "agents_ok": sum(r["ok"] for r in results), "agents": results, "lone": lone,
           "lone_after": lone_after, "wall_s": wall, **agent_summary(results, lone, lone_after)}
    print(f"{name}: chat TTFT {chat['ttft']:.3f} s; {out['agents_ok']}/{len(results)} agents done, "
          f"first tokens {[round(t, 1) for t in out['agent_ttfts_s']]} s, "
          f"prompt tokens {[r['prompt_tokens'] for r in results]}, wall {out['wall_s']:.1f} s",
          file=sys.stderr, flush=True)
    return out


def _cell(value, fmt="{:.2f}") -> str:
    return "-" if value is None else fmt.format(value)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.bench.agents_chat", description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", action="append", required=True, metavar="NAME=BASE_URL")
    ap.add_argument("--agents", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=6000, help="approximate agent prompt length")
    ap.add_argument("--agent-tokens", type=int, default=16, help="agent reply length")
    ap.add_argument("--ignore-eos", action="store_true",
                    help="agents reply their whole --agent-tokens (ignore_eos), so they hold their lanes")
    ap.add_argument("--chat-delay", type=float, default=2.0, help="seconds between the agents and the chat")
    ap.add_argument("--model")
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--no-reference", action="store_true",
                    help="skip the lone agent that gives the one-at-a-time reference")
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args(argv)
    results = []
    for spec in args.target:
        name, _, base = spec.partition("=")
        results.append(asyncio.run(run_target(name, base.rstrip("/"), args)))
    print("| target | chat TTFT (s) | lone agent before / after (s) | agents' first token mean (s) | p90 (s) "
          "| one-at-a-time mean (s) | mean / reference | p90 / reference | mean / reference before "
          "| agents completed | wall (s) |\n|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in results:
        lones = f"{_cell(r.get('lone_ttft_s'), '{:.1f}')} / {_cell(r.get('lone_after_ttft_s'), '{:.1f}')}"
        print(f"| {r['target']} | {_cell(r['chat_ttft_s'])} | {lones} | {_cell(r.get('agent_ttft_mean_s'), '{:.1f}')} "
              f"| {_cell(r.get('agent_ttft_p90_s'), '{:.1f}')} | {_cell(r.get('reference_mean_s'), '{:.1f}')} "
              f"| {_cell(r.get('mean_over_reference'))} | {_cell(r.get('p90_over_reference'))} "
              f"| {_cell(r.get('mean_over_reference_before'))} | {r['agents_ok']}/{len(r['agents'])} | {r['wall_s']:.1f} |")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"args": vars(args), "results": results}, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
