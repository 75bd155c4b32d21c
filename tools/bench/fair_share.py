"""Fair share: what swapping the admission policy with one TOML line does to four API keys, one
of which floods the server.

    python -m tools.bench.fair_share --json fair_share.json

Four keys of one class (``agent``), in a key policy file written here: ``flood`` keeps
``--flood-concurrency`` streamed requests in flight; ``a``, ``b`` and ``c`` each send one request
at a time in a closed loop. The server (the default model, ``--max-batch`` lanes) runs
``--seconds`` per policy: first the default (first come, first served within a class), then with
the configuration file holding the one line ``fair-share = true`` (the examples/fair-share
plugin, installed by tools/dev/setup.sh). For each key: requests finished, its share of the
generated tokens (``usage.completion_tokens`` of the requests that finished inside the window)
and its median and p95 time to first token (a request still waiting for its first token when the
window ends counts with its wait so far, a lower bound, so starvation is not hidden). A request
still running at the window's end is cancelled (the client disconnects); its tokens are not
counted. JSON (``--json``) and a markdown table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

from .client import sse_data

KEYS = ("flood", "a", "b", "c")
POLICIES = {"default": "", "fair-share": "fair-share = true\n"}


def write_policy(path: Path) -> dict[str, str]:
    """A key policy with the four keys (class agent); name -> secret."""
    from plugins.http.keys.policy import hash_secret
    found = {name: "sk-sf-bench-" + secrets.token_urlsafe(16) for name in KEYS}
    path.write_text("".join(f'[keys.{n}]\nsha256 = "{hash_secret(s)}"\nclass = "agent"\n\n' for n, s in found.items()))
    return found


def p95(values: list[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(0.95 * len(ordered)) - 1))]


async def one(session, base, secret, model, prompt, max_tokens, record) -> None:
    """One streamed chat: its first-token time and, once finished, its completion tokens."""
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    sent, first, tokens = time.monotonic(), False, None
    record["waiting"][id(body)] = sent
    try:
        async with session.post(f"{base}/v1/chat/completions", json=body,
                                headers={"Authorization": f"Bearer {secret}"}) as resp:
            if resp.status != 200:
                raise RuntimeError(f"HTTP {resp.status}: {(await resp.text())[:300]}")
            async for payload in sse_data(resp.content):
                chunk = json.loads(payload)
                if not first and any((c.get("delta") or {}).get("content") for c in chunk.get("choices") or ()):
                    first = True
                    record["ttft"].append(time.monotonic() - sent)
                    record["waiting"].pop(id(body))
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
    finally:
        record["waiting"].pop(id(body), None)
    record["tokens"] += tokens or 0
    record["requests"] += 1


async def client_loop(session, base, secret, model, key, worker, args, record, deadline) -> None:
    n = 0
    while time.monotonic() < deadline:
        prompt = f"[{key}-{worker}-{n}] Write a short paragraph about the number {n + 7 * worker}."
        n += 1
        try:
            await asyncio.wait_for(one(session, base, secret, model, prompt, args.max_tokens, record),
                                   max(0.1, deadline - time.monotonic()))
        except asyncio.TimeoutError:  # the window ended mid-request: its tokens are not counted
            return


async def run_policy(base: str, keys: dict[str, str], args) -> dict:
    records = {k: {"ttft": [], "tokens": 0, "requests": 0, "waiting": {}, "censored": []} for k in KEYS}
    deadline = time.monotonic() + args.seconds
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=args.seconds + 120)) as session:
        tasks = [client_loop(session, base, keys["flood"], "smollm2", "flood", w, args, records["flood"], deadline)
                 for w in range(args.flood_concurrency)]
        tasks += [client_loop(session, base, keys[k], "smollm2", k, 0, args, records[k], deadline) for k in KEYS[1:]]
        async def watch():  # at the window's end: the waits of requests with no first token yet
            await asyncio.sleep(max(0.0, deadline - time.monotonic() - 0.05))
            now = time.monotonic()
            for r in records.values():
                r["censored"] = [now - t for t in r["waiting"].values()]
        await asyncio.gather(watch(), *tasks)
    total = sum(r["tokens"] for r in records.values()) or 1
    out = {}
    for k, r in records.items():
        ttfts = r["ttft"] + r["censored"]  # a request still waiting counts with its wait so far
        out[k] = {"requests": r["requests"], "tokens": r["tokens"], "token_share": r["tokens"] / total,
                  "first_tokens": len(r["ttft"]), "still_waiting": len(r["censored"]),
                  "ttft_median_s": statistics.median(ttfts) if ttfts else None, "ttft_p95_s": p95(ttfts)}
    return out


def table(report: dict) -> str:
    rows = ["| policy | key | requests | token share | TTFT median (s) | TTFT p95 (s) |", "|---|---|---:|---:|---:|---:|"]
    for policy, keys in report["policies"].items():
        for k, r in keys.items():
            med = "-" if r["ttft_median_s"] is None else f"{r['ttft_median_s']:.2f}"
            tail = "-" if r["ttft_p95_s"] is None else f"{r['ttft_p95_s']:.2f}"
            rows.append(f"| {policy} | {k} | {r['requests']} | {100 * r['token_share']:.1f} % | {med} | {tail} |")
    return "\n".join(rows)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m tools.bench.fair_share", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="GGUF to serve (default: superfluid's default model)")
    ap.add_argument("--max-batch", type=int, default=4, help="the server's lanes")
    ap.add_argument("--max-context", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=1,
                    help="the engine's threads (1: on a shared 2-core machine, 2 threads spin against other load)")
    ap.add_argument("--seconds", type=float, default=60.0, help="the window per policy")
    ap.add_argument("--flood-concurrency", type=int, default=12, help="requests the flooding key keeps in flight")
    ap.add_argument("--max-tokens", type=int, default=48, help="tokens per reply (ignore_eos: all of them)")
    ap.add_argument("--policy", dest="policies", action="append", choices=list(POLICIES),
                    help="run only these (default: both)")
    ap.add_argument("--json", metavar="PATH")
    return ap


def main(argv=None) -> int:
    from tools.suite.targets import ServeConfig, default_model, start
    args = parser().parse_args(argv)
    report = {"date": time.strftime("%Y-%m-%d"), "args": {k: v for k, v in vars(args).items() if k != "json"},
              "policies": {}}
    with tempfile.TemporaryDirectory(prefix="sf-fair-") as tmp:
        workdir = Path(tmp)
        keys = write_policy(workdir / "keys.toml")
        for policy in args.policies or list(POLICIES):
            config = workdir / f"{policy}.toml"
            config.write_text(POLICIES[policy])
            cfg = ServeConfig(lanes=args.max_batch, context=args.max_context,
                              extra=["--config", str(config), "--key-policy", str(workdir / "keys.toml"),
                                     "--threads", str(args.threads)])
            server = start("superfluid", cfg, workdir / f"{policy}.log", args.model or default_model())
            try:
                report["policies"][policy] = asyncio.run(run_policy(server.base, keys, args))
            finally:
                server.stop()
            print(f"{policy}: {json.dumps(report['policies'][policy])}", file=sys.stderr, flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    print(table(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
