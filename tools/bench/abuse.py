"""Abuse: keys, floods and slow clients. Three scenarios against one superfluid server started
here with a real key policy (the security issue's measurements):

    python -m tools.bench.abuse --json abuse.json

1. **QoS ceiling** — eight agents (key ``agents``, class agent) prefill long prompts on all
   eight lanes; a key whose ceiling is ``agent`` sends a chat with ``x-superfluid-qos:
   interactive``: it must not preempt (``superfluid_preemptions_total`` unchanged) and its
   response says ``x-superfluid-qos: agent``. Contrast, same setup: an ``interactive`` key's
   chat preempts (counter +1) and gets its first token within a second.
2. **FIM flood** — one key floods ``POST /infill`` (on ``--fim-model``, the tiny FIM GGUF the
   tests write, since SmolLM2 has no FIM tokens) past ``--completion-rate``/``--completion-burst``:
   counts of 200s and of 429s carrying ``Retry-After``; meanwhile another key's interactive
   chat is timed to its first token.
3. **Slowloris** — ``--slow-connections`` sockets each send half a request head, then trickle a
   header line a second or send nothing, for at most ``--slow-seconds``; meanwhile a chat is
   timed. Reports what the slow sockets got back (408 after ``--header-timeout``) and that
   /health answers afterwards.

The server is started on a free loopback port and stopped by PID; the policy file holds the
SHA-256 of secrets generated here. Every loop is bounded in count and time. A JSON report
(``--json``) and a markdown table on stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import resource
import secrets
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

from .agents_chat import agent_prompt

KEYS = {  # name -> class (the key's ceiling)
    "agents": "agent",
    "ceiling": "agent",
    "interactive": "interactive",
    "flood": "completion",
}


def write_policy(path: Path) -> dict[str, str]:
    """Write a key policy for :data:`KEYS` and return name -> secret."""
    from plugins.http.keys.policy import hash_secret
    found = {name: "sk-sf-bench-" + secrets.token_urlsafe(24) for name in KEYS}
    text = "".join(f'[keys.{n}]\nsha256 = "{hash_secret(s)}"\nclass = "{KEYS[n]}"\n\n'
                   for n, s in found.items())
    path.write_text(text)
    return found


def auth(secret: str, qos: str | None = None) -> dict[str, str]:
    h = {"Authorization": f"Bearer {secret}"}
    if qos:
        h["x-superfluid-qos"] = qos
    return h


def raise_nofile(needed: int) -> dict:
    """Raise this process's soft open-files limit to at least ``needed`` (up to the hard one)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    new = soft
    if soft != resource.RLIM_INFINITY and soft < needed:
        new = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
    return {"soft_before": soft, "soft_after": new, "hard": hard, "raised": new != soft}


async def metric(session, base, secret, name) -> float:
    async with session.get(f"{base}/metrics", headers=auth(secret),
                           timeout=aiohttp.ClientTimeout(total=30)) as r:
        text = await r.text()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and (len(line) == len(name) or line[len(name)] in " {"):
            total += float(line.rsplit(" ", 1)[1])
    return total


async def chat(session, base, model, headers, timeout, text="Say hello in five words.") -> dict:
    """One streamed chat, timed to its first content delta; its status and x-superfluid-qos."""
    t0 = time.monotonic()
    ttft = None
    async with session.post(f"{base}/v1/chat/completions", json={
            "model": model, "messages": [{"role": "user", "content": text}],
            "max_tokens": 16, "temperature": 0, "stream": True},
            headers=headers, timeout=aiohttp.ClientTimeout(total=timeout)) as r:
        status, qos = r.status, r.headers.get("x-superfluid-qos")
        async for raw in r.content:
            line = raw.decode(errors="replace").strip()
            if ttft is None and line.startswith("data: {"):
                delta = (json.loads(line[6:]).get("choices") or [{}])[0].get("delta", {})
                if delta.get("content") or delta.get("reasoning_content"):
                    ttft = time.monotonic() - t0
    return {"status": status, "qos_header": qos, "ttft_s": ttft, "total_s": time.monotonic() - t0}


async def agent(session, base, model, secret, prompt, timeout) -> dict:
    async with session.post(f"{base}/v1/completions", json={
            "model": model, "prompt": prompt, "max_tokens": 16, "temperature": 0},
            headers=auth(secret, "agent"), timeout=aiohttp.ClientTimeout(total=timeout)) as r:
        body = await r.json(content_type=None)
        return {"status": r.status, "prompt_tokens": (body.get("usage") or {}).get("prompt_tokens")}


# ---- 1. QoS ceiling ----------------------------------------------------------------------------

async def ceiling_round(session, base, model, keys, who: str, qos: str, round_no: int, args) -> dict:
    prompts = [agent_prompt(100 * round_no + i, args.prompt_tokens) for i in range(args.agents)]
    before = await metric(session, base, keys["agents"], "superfluid_preemptions_total")
    agents = [asyncio.create_task(agent(session, base, model, keys["agents"], p, args.timeout)) for p in prompts]
    await asyncio.sleep(args.chat_delay)
    c = await chat(session, base, model, auth(keys[who], qos), args.timeout)
    after = await metric(session, base, keys["agents"], "superfluid_preemptions_total")
    # The agents have shown what they had to; the rest are dropped (the server frees a dropped
    # request's lane) so the next round starts on an idle server.
    finished = [t.result() for t in agents if t.done() and not t.exception()]
    for t in agents:
        t.cancel()
    await asyncio.gather(*agents, return_exceptions=True)
    await asyncio.sleep(1.0)
    return {"key": who, "key_class": KEYS[who], "asked": qos, **c,
            "preemptions_before": before, "preemptions_after": after, "preemptions_delta": after - before,
            "agents": len(agents), "agents_ok": sum(a["status"] == 200 for a in finished),
            "agent_prompt_tokens": [a["prompt_tokens"] for a in finished]}


async def scenario_ceiling(session, base, model, keys, args) -> dict:
    capped = await ceiling_round(session, base, model, keys, "ceiling", "interactive", 1, args)
    contrast = await ceiling_round(session, base, model, keys, "interactive", "interactive", 2, args)
    return {"capped": capped, "contrast": contrast}


# ---- 2. FIM flood ------------------------------------------------------------------------------

async def scenario_fim(session, base, model, keys, args) -> dict:
    counts: dict[str, int] = {}
    retry_after: list[int] = []
    sent = 0
    t0 = time.monotonic()
    end = t0 + args.flood_seconds

    async def worker():
        nonlocal sent
        while sent < args.flood_requests and time.monotonic() < end:
            sent += 1
            try:
                async with session.post(f"{base}/infill", json={
                        "input_prefix": "def add(a, b):\n    ", "input_suffix": "\n    return c\n",
                        "n_predict": 4}, headers=auth(keys["flood"]),
                        timeout=aiohttp.ClientTimeout(total=60)) as r:
                    await r.read()
                    counts[str(r.status)] = counts.get(str(r.status), 0) + 1
                    if r.status == 429 and r.headers.get("Retry-After"):
                        retry_after.append(int(r.headers["Retry-After"]))
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                counts[type(exc).__name__] = counts.get(type(exc).__name__, 0) + 1

    workers = [asyncio.create_task(worker()) for _ in range(args.flood_concurrency)]
    await asyncio.sleep(1.0)
    chats = []
    for _ in range(3):  # three chats spread over the flood
        chats.append(await chat(session, base, model, auth(keys["interactive"], "interactive"), args.timeout))
        await asyncio.sleep(0.5)
    await asyncio.gather(*workers)
    wall = time.monotonic() - t0
    return {"sent": sent, "wall_s": wall, "rate_per_s": sent / wall, "statuses": counts,
            "with_retry_after": len(retry_after),
            "retry_after_range": [min(retry_after), max(retry_after)] if retry_after else None,
            "chats": chats, "chat_ttft_max_s": max((c["ttft_s"] or 1e9) for c in chats)}


# ---- 3. Slowloris ------------------------------------------------------------------------------

async def slow_client(host, port, trickle: bool, seconds: float) -> dict:
    t0 = time.monotonic()
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), 10)
    except (OSError, asyncio.TimeoutError) as exc:
        return {"outcome": f"connect failed: {type(exc).__name__}", "closed_after_s": None}
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n")
    got = b""
    deadline = t0 + seconds
    try:
        k = 0
        while time.monotonic() < deadline:
            try:
                chunk = await asyncio.wait_for(reader.read(4096), 1.0 if trickle else deadline - time.monotonic())
            except asyncio.TimeoutError:
                chunk = None
            if chunk == b"":
                break  # the server closed
            if chunk:
                got += chunk
                continue
            if trickle and k < 60:
                k += 1
                writer.write(f"X-Slow-{k}: {'a' * 8}\r\n".encode())
                await writer.drain()
    except (ConnectionError, OSError):
        pass
    closed = time.monotonic() - t0
    writer.close()
    m = re.match(rb"HTTP/1\.[01] (\d{3})", got)
    status = m.group(1).decode() if m else None
    outcome = status or ("closed, no response" if closed < seconds else "still open at the bound")
    return {"outcome": outcome, "closed_after_s": closed if closed < seconds else None}


async def scenario_slowloris(session, base, model, keys, args) -> dict:
    host, port = base.split("//", 1)[1].rsplit(":", 1)
    t0 = time.monotonic()
    slow = [asyncio.create_task(slow_client(host, int(port), i % 2 == 1, args.slow_seconds))
            for i in range(args.slow_connections)]
    await asyncio.sleep(2.0)  # all connected and half-sent
    chats = [await chat(session, base, model, auth(keys["interactive"]), args.timeout)]
    await asyncio.sleep(max(0.0, args.header_timeout - (time.monotonic() - t0) - 2.0))
    chats.append(await chat(session, base, model, auth(keys["interactive"]), args.timeout))  # near the cut-off
    results = await asyncio.gather(*slow)
    outcomes: dict[str, dict] = {}
    for mode, res in (("silent", results[0::2]), ("trickle", results[1::2])):
        for r in res:
            o = outcomes.setdefault(mode, {})
            o[r["outcome"]] = o.get(r["outcome"], 0) + 1
    closed = [r["closed_after_s"] for r in results if r["closed_after_s"] is not None]
    async with session.get(f"{base}/health", timeout=aiohttp.ClientTimeout(total=10)) as r:
        health = r.status
    after = await chat(session, base, model, auth(keys["interactive"]), args.timeout)
    return {"connections": args.slow_connections, "outcomes": outcomes,
            "closed_after_s": [min(closed), max(closed)] if closed else None,
            "chats": chats, "chat_ttft_max_s": max((c["ttft_s"] or 1e9) for c in chats),
            "health_after": health, "chat_after": after, "wall_s": time.monotonic() - t0}


# ---- the server, the report --------------------------------------------------------------------

def tiny_fim_model(workdir: Path) -> str:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from tests.tinygguf import write_tiny_llama
    return str(write_tiny_llama(workdir / "tiny-fim.gguf", quant="Q8_0"))


def start_server(args, workdir: Path, policy: Path):
    from tools.suite.targets import ServeConfig, default_model, start
    fim = args.fim_model or tiny_fim_model(workdir)
    extra = ["--key-policy", str(policy), "--fim-model", fim, "--header-timeout", str(args.header_timeout),
             "--max-connections", str(args.max_connections)]
    cfg = ServeConfig(lanes=args.agents, context=args.max_context, extra=extra)
    return start("superfluid", cfg, workdir / "server.log", args.model or default_model())


def table(report: dict) -> str:
    s1, s2, s3 = report.get("ceiling"), report.get("fim"), report.get("slowloris")
    rows = ["| scenario | what | result |", "|---|---|---:|"]

    def f(x):
        return "-" if x is None else f"{x:.2f}"
    if s1:
        for label, r in (("ceiling key (agent) asks interactive", s1["capped"]),
                         ("interactive key, contrast", s1["contrast"])):
            rows.append(f"| QoS ceiling | {label}: preemptions +{r['preemptions_delta']:g}, "
                        f"x-superfluid-qos `{r['qos_header']}`, agents done before the chat's end {r['agents_ok']}/{r['agents']} "
                        f"| TTFT {f(r['ttft_s'])} s |")
    if s2:
        rows.append(f"| FIM flood | {s2['sent']} /infill in {s2['wall_s']:.1f} s: statuses {s2['statuses']}, "
                    f"{s2['with_retry_after']} 429s with Retry-After {s2['retry_after_range']} "
                    f"| chat TTFT max {f(s2['chat_ttft_max_s'])} s |")
    if s3:
        rows.append(f"| Slowloris | {s3['connections']} slow connections: {s3['outcomes']}, closed after "
                    f"{[round(x, 1) for x in s3['closed_after_s'] or []]} s; /health after {s3['health_after']} "
                    f"| chat TTFT max {f(s3['chat_ttft_max_s'])} s |")
    return "\n".join(rows)


async def run(args, base, keys) -> dict:
    report: dict = {}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        async with session.get(f"{base}/v1/models", headers=auth(keys["interactive"])) as r:
            models = [m["id"] for m in (await r.json())["data"]]
        model = args.model_name or next(m for m in models if m != "fim")
        if "ceiling" in args.scenarios:
            report["ceiling"] = await scenario_ceiling(session, base, model, keys, args)
            print("ceiling:", json.dumps(report["ceiling"]), file=sys.stderr, flush=True)
        if "fim" in args.scenarios:
            report["fim"] = await scenario_fim(session, base, model, keys, args)
            print("fim:", json.dumps(report["fim"]), file=sys.stderr, flush=True)
        if "slowloris" in args.scenarios:
            report["slowloris"] = await scenario_slowloris(session, base, model, keys, args)
            print("slowloris:", json.dumps(report["slowloris"]), file=sys.stderr, flush=True)
    return report


SCENARIOS = ("ceiling", "fim", "slowloris")


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m tools.bench.abuse", description=__doc__.split("\n\n")[0])
    ap.add_argument("--scenario", dest="scenarios", action="append", choices=SCENARIOS,
                    help="run only these (repeatable; default: all three)")
    ap.add_argument("--target", metavar="BASE_URL",
                    help="a running server instead of starting one; needs --key-file")
    ap.add_argument("--key-file", metavar="JSON",
                    help=f"with --target: {{name: secret}} for the keys {', '.join(KEYS)} (classes {KEYS})")
    ap.add_argument("--model", help="GGUF to serve (default: superfluid's default model)")
    ap.add_argument("--model-name", help="model id to call (default: the first non-FIM one listed)")
    ap.add_argument("--fim-model", help="FIM GGUF for --fim-model (default: the tests' tiny FIM model)")
    ap.add_argument("--agents", type=int, default=8, help="agents, also the server's --max-batch")
    ap.add_argument("--max-context", type=int, default=4096)
    ap.add_argument("--prompt-tokens", type=int, default=2000, help="approximate agent prompt length")
    ap.add_argument("--chat-delay", type=float, default=5.0,
                    help="seconds between the agents and the chat (all eight must be prefilling by then)")
    ap.add_argument("--flood-requests", type=int, default=400)
    ap.add_argument("--flood-seconds", type=float, default=8.0)
    ap.add_argument("--flood-concurrency", type=int, default=16)
    ap.add_argument("--slow-connections", type=int, default=500)
    ap.add_argument("--slow-seconds", type=float, default=30.0, help="the most a slow socket is held")
    ap.add_argument("--header-timeout", type=float, default=10.0, help="the server's --header-timeout")
    ap.add_argument("--max-connections", type=int, default=1024, help="the server's --max-connections")
    ap.add_argument("--timeout", type=float, default=600.0, help="per request")
    ap.add_argument("--json", metavar="PATH")
    return ap


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    args.scenarios = args.scenarios or list(SCENARIOS)
    if args.target and not args.key_file:
        parser().error("--target needs --key-file")
    nofile = raise_nofile(args.slow_connections + 256)
    server = None
    with tempfile.TemporaryDirectory(prefix="sf-abuse-") as tmp:
        workdir = Path(tmp)
        try:
            if args.target:
                base, keys = args.target.rstrip("/"), json.loads(Path(args.key_file).read_text())
            else:
                keys = write_policy(workdir / "keys.toml")
                server = start_server(args, workdir, workdir / "keys.toml")
                base = server.base
            t0 = time.monotonic()
            report = asyncio.run(run(args, base, keys))
            report["wall_s"] = time.monotonic() - t0
            report["nofile"] = nofile
            report["server_alive_after"] = server.alive() if server else None
        finally:
            if server is not None:
                log = server.log_text()
                server.stop()
                if args.json:
                    Path(args.json).with_suffix(".server.log").write_text(log)
    out = {k: v for k, v in vars(args).items()}
    print(table(report))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"args": out, **report}, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
