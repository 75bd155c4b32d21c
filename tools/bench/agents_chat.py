"""Agents + interactive chat: eight agents prefilling long prompts, then one short chat in the
interactive class. Reports the chat's time to first token on each target.

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

from .client import first_model

FILLER = ("The quick brown fox jumps over the lazy dog while the committee reviews section {i} "
          "of the report on distributed systems, caching strategies and scheduling policies. ")


def agent_prompt(index: int, approx_tokens: int) -> str:
    """A distinct long prompt of about ``approx_tokens`` tokens: a sentence is about 34 tokens with
    SmolLM2's tokenizer (measured: 3000 asked gives 2.8k-3.0k tokens, 6000 gives 5.7k-6.0k)."""
    body = "".join(FILLER.format(i=f"{index}.{k}") for k in range(max(1, approx_tokens // 34)))
    return (f"<|im_start|>user\nAgent {index}: summarize the following notes.\n{body}<|im_end|>\n"
            "<|im_start|>assistant\n")


async def _agent(session, base, model, prompt, max_tokens, timeout, ignore_eos=False):
    t0 = time.monotonic()
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    if ignore_eos:  # llama.cpp's extension: the reply runs its whole length
        body["ignore_eos"] = True
    async with session.post(f"{base}/v1/completions", json=body,
            headers={"x-superfluid-qos": "agent"}, timeout=aiohttp.ClientTimeout(total=timeout)) as r:
        body = await r.json(content_type=None)
        ok = r.status == 200
    return {"ok": ok, "seconds": time.monotonic() - t0,
            "prompt_tokens": body.get("usage", {}).get("prompt_tokens") if ok else None,
            "error": None if ok else str(body)[:300]}


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
        prompts = [agent_prompt(i, args.prompt_tokens) for i in range(args.agents)]
        t0 = time.monotonic()
        agents = [asyncio.create_task(_agent(session, base, model, p, args.agent_tokens, args.timeout,
                                             args.ignore_eos))
                  for p in prompts]
        await asyncio.sleep(args.chat_delay)
        chat = await _chat(session, base, model, args.timeout)
        results = await asyncio.gather(*agents)
    out = {"target": name, "base": base, "chat_ttft_s": chat["ttft"], "chat_total_s": chat["seconds"],
           "agents_ok": sum(r["ok"] for r in results), "agents": results,
           "wall_s": time.monotonic() - t0}
    print(f"{name}: chat TTFT {chat['ttft']:.3f} s; {out['agents_ok']}/{len(results)} agents done, "
          f"prompt tokens {[r['prompt_tokens'] for r in results]}, wall {out['wall_s']:.1f} s",
          file=sys.stderr, flush=True)
    return out


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
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args(argv)
    results = []
    for spec in args.target:
        name, _, base = spec.partition("=")
        results.append(asyncio.run(run_target(name, base.rstrip("/"), args)))
    print("| target | chat TTFT (s) | agents completed | wall (s) |\n|---|---:|---:|---:|")
    for r in results:
        ttft = "-" if r["chat_ttft_s"] is None else f"{r['chat_ttft_s']:.2f}"
        print(f"| {r['target']} | {ttft} | {r['agents_ok']}/{len(r['agents'])} | {r['wall_s']:.1f} |")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"args": vars(args), "results": results}, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
