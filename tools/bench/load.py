"""A bounded load run over a key policy: many concurrent clients spread over a few API keys, each
sending small generations until a deadline. Reports what the security issue asks of the door:
no 5xx, no lost request, a Retry-After on every 429, and what authentication and the key limits
add to a request (the server's ``superfluid_http_auth_seconds``, p50/p99 from its buckets).

    python -m tools.bench.load --make-keys /tmp/load          # keys.toml + secrets.txt
    superfluid serve --model M.gguf --port 8090 --key-policy /tmp/load/keys.toml
    python -m tools.bench.load --target http://127.0.0.1:8090 --keys /tmp/load/secrets.txt \\
        --clients 200 --seconds 60

Client ``i`` uses key ``i % len(keys)`` and loops: a chat or a completion (by turns), streamed or
not, ``max_tokens`` 8, a short prompt of its own, until ``--seconds`` have passed; a request
still out then has ``--drain`` more seconds to finish. A 429 is honoured: the client sleeps its
Retry-After (1 s if it has none), as an OpenAI client would; so is a 503 that carries one (a
model being unloaded or loaded). All clients share one connector
with a connection each.

Per request it records the status, whether a 429 carried Retry-After and its error code, the
client latency (send to last byte), and whether an answer came at all: *lost* is no HTTP status
(a connection error, a timeout), a whole reply that is not a JSON body with choices, or a 200
stream that ends without ``data: [DONE]``. The histogram and the per-key counters are read from
/metrics before and after, and the difference reported. Exit status 1 if any 5xx, lost request
or 429 without Retry-After was seen, 0 otherwise.

``--make-keys DIR`` writes the policy the run is meant for: ten keys, ``load-0`` and ``load-1``
at 30 requests per minute, ``load-2`` with 2 lanes, ``load-3`` at 3000 tokens per minute, the
rest unlimited (so some 429s of each kind happen); ``secrets.txt`` holds ``NAME SECRET`` lines
(mode 0600), ``keys.toml`` only their SHA-256.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import secrets
import sys
import time
from collections import Counter
from dataclasses import dataclass

import aiohttp

from .client import STREAM_DONE, sse_events

AUTH_METRIC = "superfluid_http_auth_seconds"
LIMITS = {  # the --make-keys policy: key index -> its limits (the others are unlimited)
    0: {"requests-per-minute": 30},
    1: {"requests-per-minute": 30},
    2: {"lanes": 2},
    3: {"tokens-per-minute": 3000},
}
KINDS = ("chat", "chat-stream", "completion", "completion-stream")
COLORS = ("red", "green", "blue", "amber", "violet", "teal", "coral", "olive")


@dataclass
class Result:
    client: int
    key: str
    kind: str
    status: int | None  # None: no HTTP status at all
    latency: float
    lost: str | None = None  # why no (complete) answer came: connection, timeout, truncated, bad body
    retry_after: bool = False
    retry_s: float | None = None  # its value, for the client's sleep
    code: str | None = None  # a refusal's error.code, or a stream's error event's
    stream_error: bool = False  # a 200 stream that carried an error event
    finished: bool = False  # a 200 reply whose choice carried a finish_reason


# ---- keys ------------------------------------------------------------------------------------

def make_keys(directory: str, count: int = 10) -> tuple[str, str]:
    """Write ``keys.toml`` and ``secrets.txt`` under ``directory``; return their paths."""
    import hashlib

    os.makedirs(directory, exist_ok=True)
    policy, lines = ["# tools.bench.load --make-keys: the load run's keys\n"], []
    for i in range(count):
        name, secret = f"load-{i}", "sk-sf-load-" + secrets.token_urlsafe(24)
        policy.append(f'[keys.{name}]\nsha256 = "{hashlib.sha256(secret.encode()).hexdigest()}"\n')
        policy.extend(f"{field} = {value}\n" for field, value in LIMITS.get(i, {}).items())
        policy.append("\n")
        lines.append(f"{name} {secret}\n")
    policy_path, secrets_path = os.path.join(directory, "keys.toml"), os.path.join(directory, "secrets.txt")
    with open(policy_path, "w", encoding="utf-8") as f:
        f.write("".join(policy))
    fd = os.open(secrets_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write("".join(lines))
    return policy_path, secrets_path


def read_keys(path: str) -> list[tuple[str, str]]:
    """``NAME SECRET`` lines (or a bare secret, named by its line), ``#`` comments skipped."""
    keys = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            parts = line.split("#", 1)[0].split()
            if len(parts) == 1:
                keys.append((f"line-{n}", parts[0]))
            elif len(parts) >= 2:
                keys.append((parts[0], parts[1]))
    if not keys:
        raise SystemExit(f"{path}: no keys")
    return keys


# ---- one request -----------------------------------------------------------------------------

def body_for(kind: str, model: str, client: int, n: int) -> tuple[str, dict]:
    color = COLORS[(client + n) % len(COLORS)]
    text = f"Client {client}, request {n}: name a fruit that is {color}."
    body: dict = {"model": model, "max_tokens": 8, "temperature": 0.7, "stream": kind.endswith("stream")}
    if kind.startswith("chat"):
        body["messages"] = [{"role": "user", "content": text}]
        return "/v1/chat/completions", body
    body["prompt"] = text + " Answer:"
    return "/v1/completions", body


async def one(session, base, secret, key_name, model, client, n, kind, timeout) -> Result:
    path, body = body_for(kind, model, client, n)
    sent = time.perf_counter()
    result = Result(client=client, key=key_name, kind=kind, status=None, latency=0.0)
    try:
        async with session.post(base + path, json=body, headers={"Authorization": f"Bearer {secret}"},
                                timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
            result.status = resp.status
            if resp.status == 200 and body["stream"]:
                done = False
                async for event in sse_events(resp.content):
                    if event is STREAM_DONE:
                        done = True
                    elif "error" in event:
                        result.stream_error = True
                        error = event["error"]
                        result.code = error.get("code") if isinstance(error, dict) else None
                    elif _finish_reason(event):
                        result.finished = True
                if not done:
                    result.lost = "truncated stream"
            else:
                raw = await resp.read()
                try:
                    data = json.loads(raw)
                except ValueError:
                    data = None
                if resp.status == 200:
                    if not (isinstance(data, dict) and data.get("choices")):
                        result.lost = "bad body"
                    else:
                        result.finished = _finish_reason(data)
                else:
                    error = data.get("error") if isinstance(data, dict) else None
                    result.code = error.get("code") if isinstance(error, dict) else None
                    value = resp.headers.get("Retry-After")
                    result.retry_after = value is not None
                    try:
                        result.retry_s = float(value) if value is not None else None
                    except ValueError:
                        pass
    except asyncio.TimeoutError:
        result.lost = "timeout"
    except (aiohttp.ClientError, ConnectionError) as exc:
        result.lost = f"connection: {type(exc).__name__}"
    result.latency = time.perf_counter() - sent
    return result


def _finish_reason(body: dict) -> bool:
    """Whether a reply (or a stream's chunk) names a finish_reason in its first choice."""
    choices = body.get("choices")
    return bool(isinstance(choices, list) and choices and isinstance(choices[0], dict)
                and choices[0].get("finish_reason"))


# ---- /metrics --------------------------------------------------------------------------------

async def scrape(session, base, secret) -> dict:
    """{(name, labels): value} of the server's /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    async with session.get(base + "/metrics", headers={"Authorization": f"Bearer {secret}"},
                           timeout=aiohttp.ClientTimeout(total=30)) as resp:
        text = await resp.text()
        if resp.status != 200:
            raise SystemExit(f"GET /metrics: HTTP {resp.status}: {text[:300]}")
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def delta(after: dict, before: dict) -> dict:
    return {k: v - before.get(k, 0.0) for k, v in after.items()}


def histogram(samples: dict, name: str) -> tuple[list[tuple[float, float]], float, float]:
    """Cumulative ``(upper bound, count)`` buckets, the count and the sum of histogram ``name``
    (its series summed over any labels)."""
    buckets: dict[float, float] = {}
    count = total = 0.0
    for (sample, labels), value in samples.items():
        if sample == name + "_bucket":
            le = float(dict(labels)["le"])
            buckets[le] = buckets.get(le, 0.0) + value
        elif sample == name + "_count":
            count += value
        elif sample == name + "_sum":
            total += value
    return sorted(buckets.items()), count, total


def quantile(buckets: list[tuple[float, float]], q: float) -> float | None:
    """Prometheus's histogram_quantile: linear within the bucket the rank falls in (the largest
    finite bound if it falls in +Inf); None for an empty histogram."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower, below = 0.0, 0.0
    for bound, cumulative in buckets:
        if cumulative >= rank:
            if math.isinf(bound):
                return lower
            if cumulative == below:
                return bound
            return lower + (bound - lower) * (rank - below) / (cumulative - below)
        lower, below = bound, cumulative
    return lower


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, max(0, math.ceil(q * len(values)) - 1))]


# ---- the run ---------------------------------------------------------------------------------

async def run(args, results: list[Result] | None = None) -> dict:
    """The run's report; ``results``, if given, receives every request's :class:`Result` (a
    caller that classifies them itself: tools/chaos)."""
    keys = read_keys(args.keys)
    base = args.target.rstrip("/")
    connector = aiohttp.TCPConnector(limit=args.clients + 4, limit_per_host=args.clients + 4)
    results = [] if results is None else results
    async with aiohttp.ClientSession(connector=connector) as session:
        if args.model:
            model = args.model
        else:
            async with session.get(base + "/v1/models", headers={"Authorization": f"Bearer {keys[-1][1]}"},
                                   timeout=aiohttp.ClientTimeout(total=30)) as resp:
                model = (await resp.json(content_type=None))["data"][0]["id"]
        before = await scrape(session, base, keys[-1][1])

        started = time.monotonic()
        deadline = started + args.seconds
        tasks = [asyncio.create_task(_client(session, base, keys[i % len(keys)], model, i, deadline,
                                             args.drain, results))
                 for i in range(args.clients)]
        done, pending = await asyncio.wait(tasks, timeout=args.seconds + args.drain + 5)
        for task in pending:  # a client past the drain: its request is lost
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        elapsed = time.monotonic() - started
        failures = [t.exception() for t in done if t.exception() is not None]
        after = await scrape(session, base, keys[-1][1])
    return report(args, keys, results, delta(after, before), elapsed, len(pending), failures)


async def _client(session, base, key, model, client, deadline, drain, results):
    key_name, secret = key
    n = 0
    while time.monotonic() < deadline:
        kind = KINDS[(client + n) % len(KINDS)]
        timeout = max(1.0, deadline + drain - time.monotonic())
        result = await one(session, base, secret, key_name, model, client, n, kind, timeout)
        results.append(result)
        n += 1
        if result.status == 429 or (result.status == 503 and result.retry_after):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            await asyncio.sleep(min(result.retry_s if result.retry_s is not None else 1.0, left))


def report(args, keys, results: list[Result], metrics: dict, elapsed: float, cut: int, failures) -> dict:
    statuses = Counter(str(r.status) if r.status is not None else "none" for r in results)
    lost = [r for r in results if r.lost is not None]
    refused = [r for r in results if r.status == 429]
    ok = [r.latency for r in results if r.status == 200 and r.lost is None]
    buckets, auth_count, auth_sum = histogram(metrics, AUTH_METRIC)
    per_key = {}
    for name, _ in keys:
        label = (("key", name),)
        per_key[name] = {
            "sent": sum(1 for r in results if r.key == name),
            "200": sum(1 for r in results if r.key == name and r.status == 200),
            "429": sum(1 for r in results if r.key == name and r.status == 429),
            "admitted": metrics.get(("superfluid_key_requests_total", label), 0.0),
            "rejected": {dict(lbl)["reason"]: v for (s, lbl), v in metrics.items()
                         if s == "superfluid_key_rejections_total" and dict(lbl).get("key") == name and v},
            "prompt_tokens": metrics.get(("superfluid_key_tokens_total", (("key", name), ("kind", "prompt"))), 0.0),
            "completion_tokens": metrics.get(("superfluid_key_tokens_total",
                                              (("key", name), ("kind", "completion"))), 0.0),
        }
    out = {
        "target": args.target, "clients": args.clients, "keys": len(keys), "seconds": args.seconds,
        "drain": args.drain, "elapsed_s": round(elapsed, 1),
        "requests": len(results), "statuses": dict(sorted(statuses.items())),
        "5xx": sum(1 for r in results if r.status is not None and r.status >= 500),
        "lost": len(lost) + cut, "lost_reasons": dict(Counter(r.lost for r in lost)),
        "cut_at_drain": cut, "client_failures": [repr(f) for f in failures],
        "429": len(refused), "429_without_retry_after": sum(1 for r in refused if not r.retry_after),
        "429_codes": dict(Counter(r.code for r in refused)),
        "stream_errors": sum(1 for r in results if r.stream_error),
        "no_finish_reason": sum(1 for r in results
                                if r.status == 200 and r.lost is None and not r.stream_error and not r.finished),
        "latency_s": {
            "all_p50": percentile([r.latency for r in results], 0.5),
            "all_p99": percentile([r.latency for r in results], 0.99),
            "200_p50": percentile(ok, 0.5), "200_p99": percentile(ok, 0.99),
            "429_p50": percentile([r.latency for r in refused], 0.5),
            "429_p99": percentile([r.latency for r in refused], 0.99),
        },
        "auth": {"observed": auth_count, "mean_s": auth_sum / auth_count if auth_count else None,
                 "p50_s": quantile(buckets, 0.5), "p99_s": quantile(buckets, 0.99),
                 "buckets": [[b, c] for b, c in buckets]},
        "per_key": per_key,
    }
    return out


def show(out: dict) -> None:
    def ms(v):
        return "-" if v is None else f"{v * 1000:.1f} ms"

    def us(v):
        return "-" if v is None else f"{v * 1e6:.0f} µs"

    lat, auth = out["latency_s"], out["auth"]
    print(f"load: {out['clients']} clients over {out['keys']} keys, {out['seconds']:g} s "
          f"(+{out['drain']:g} s drain), {out['elapsed_s']} s in all, against {out['target']}")
    print(f"  requests {out['requests']}   statuses {out['statuses']}")
    print(f"  5xx {out['5xx']}   lost {out['lost']} {out['lost_reasons'] or ''}"
          f"{'   cut at drain ' + str(out['cut_at_drain']) if out['cut_at_drain'] else ''}"
          f"   stream errors {out['stream_errors']}")
    print(f"  429 {out['429']} {out['429_codes']}   without Retry-After {out['429_without_retry_after']}")
    print(f"  client latency: all p50 {ms(lat['all_p50'])} p99 {ms(lat['all_p99'])}; "
          f"200 p50 {ms(lat['200_p50'])} p99 {ms(lat['200_p99'])}; "
          f"429 p50 {ms(lat['429_p50'])} p99 {ms(lat['429_p99'])}")
    print(f"  auth+limits per request ({AUTH_METRIC}, {auth['observed']:.0f} observed): "
          f"p50 {us(auth['p50_s'])}  p99 {us(auth['p99_s'])}  mean {us(auth['mean_s'])}")
    print("  per key: sent/200/429, admitted by the server, refusals by reason, tokens prompt+completion")
    for name, k in out["per_key"].items():
        print(f"    {name:10s} {k['sent']:5d} {k['200']:5d} {k['429']:5d}   admitted {k['admitted']:5.0f}  "
              f"{k['rejected'] or ''}  tokens {k['prompt_tokens']:.0f}+{k['completion_tokens']:.0f}")
    if out["client_failures"]:
        print(f"  client tasks failed: {out['client_failures'][:3]}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.bench.load", description=__doc__.split("\n\n")[0])
    ap.add_argument("--make-keys", metavar="DIR", help="write DIR/keys.toml and DIR/secrets.txt, then exit")
    ap.add_argument("--target", metavar="BASE_URL", help="e.g. http://127.0.0.1:8090")
    ap.add_argument("--keys", metavar="FILE", help="NAME SECRET lines (what --make-keys writes)")
    ap.add_argument("--clients", type=int, default=200)
    ap.add_argument("--seconds", type=float, default=60.0, help="how long clients start new requests")
    ap.add_argument("--drain", type=float, default=60.0, help="how long requests still out may take after")
    ap.add_argument("--model", help="model id (default: the first /v1/models lists)")
    ap.add_argument("--json", metavar="FILE", help="also write the report as JSON")
    args = ap.parse_args(argv)
    if args.make_keys:
        policy, secrets_path = make_keys(args.make_keys)
        print(f"wrote {policy} and {secrets_path}")
        return 0
    if not args.target or not args.keys:
        ap.error("--target and --keys are needed (or --make-keys DIR)")
    out = asyncio.run(run(args))
    show(out)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(out, f, indent=1)
    return 1 if out["5xx"] or out["lost"] or out["429_without_retry_after"] or out["client_failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
