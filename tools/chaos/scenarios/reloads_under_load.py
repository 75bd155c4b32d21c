"""Policy reloads and unloads under load: while keyed clients keep the server busy (the load
tool's clients, :mod:`tools.bench.load`), the key policy is rewritten and the daemon SIGHUPed
many times, and the model is unloaded and loaded again a few times.

Each reload adds a fresh probe key and removes the previous one, and changes one client key's
limit; one reload in every ten writes a malformed file, which must keep the old policy. After
each SIGHUP the scenario checks the reload took effect: the new probe key is accepted within
5 s and the removed one gets 401 (after a malformed file: the old probe key still works and the
new one is refused). The clients' keys stay in every policy, so none of them may ever get 401.

Every answer is classified:

* **whole**: 200 with a body whose choice has a ``finish_reason``, or a stream that names a
  ``finish_reason`` and ends in ``[DONE]``;
* **documented refusal**, each with where it is documented and why this fault may cause it:

  - 429 ``rate_limit_exceeded`` with ``Retry-After`` (docs/security.md): the policy's
    per-minute keys (``load-0``, ``load-1``, ``load-3``, and ``load-4`` in every second policy);
  - 429 ``too_many_concurrent_requests`` with ``Retry-After`` (docs/security.md): ``load-2``'s
    ``lanes = 2``;
  - 429 ``queue_full`` with ``Retry-After`` (docs/security.md): a class's queue at
    ``--max-queue`` (not expected at this load, allowed because it is documented);
  - 503 ``model_unloaded`` with ``Retry-After`` (docs/api.md): a request that arrives while the
    model is unloaded or loading, or that was queued when the unload began;
  - a 200 stream whose last event is the error ``model_unloaded`` (docs/api.md, the unload route:
    a stream still running when the drain timeout ends gets it as its last event);
* **lost** (the load tool's definition): no HTTP status, a timeout, a 200 body without choices,
  a stream without ``[DONE]``, or a request still out when the run ends;
* **undocumented**: anything else: a 401 for a client key (the reloads must keep them), a 5xx
  other than the 503 above, any other code or one without ``Retry-After``, a stream error with
  another code, a 200 without a ``finish_reason``.

The clients honour ``Retry-After`` on 429 and 503, as the OpenAI SDK does.

Pass: 0 lost, 0 undocumented, every reload took effect (and the malformed ones kept the old
policy), every unload and load answered 200, the daemon is up and a request after the last load
succeeds."""

from __future__ import annotations

import asyncio
import hashlib
import os
import secrets
import signal
import time
from argparse import Namespace
from collections import Counter
from pathlib import Path

import aiohttp

from tools.bench import load as loadtool
from tools.suite.common import call

from ..common import MODEL_NAME, Ctx, Outcome, verdict

KEY, TITLE = "reloads_under_load", "reloads under load"
FAULT = ("the key policy rewritten and SIGHUPed (one write in ten malformed), and the model unloaded and loaded, "
         "under load")
PASS = ("0 lost requests; every answer whole or a documented refusal (429 with a key's or the queue's code, "
        "503 model_unloaded, each with Retry-After; a stream's model_unloaded event); every reload took effect, "
        "a malformed one kept the old policy; the daemon up")
FULL = {"clients": 100, "seconds": 90.0, "reloads": 20, "unloads": 5, "drain_s": 2.0, "lanes": 4}
FAST = {"clients": 16, "seconds": 10.0, "reloads": 4, "unloads": 1, "drain_s": 1.0, "lanes": 4}
HEADLINE = ["requests", "whole", "documented", "lost", "undocumented", "reloads", "reloads_effective",
            "malformed_kept_old", "reload_s", "unloads", "saw_model_unloaded", "latency_p50_s", "latency_p99_s"]
DOCUMENTED = {429: {"rate_limit_exceeded", "too_many_concurrent_requests", "queue_full"}, 503: {"model_unloaded"}}
DOCUMENTED_STREAM_ERRORS = {"model_unloaded"}


def unavailable() -> str | None:
    return None if hasattr(signal, "SIGHUP") else "no SIGHUP on this platform"


def _entry(name: str, secret: str, **fields) -> str:
    lines = [f"[keys.{name}]", f'sha256 = "{hashlib.sha256(secret.encode()).hexdigest()}"']
    lines += [f"{k} = {str(v).lower() if isinstance(v, bool) else v}" for k, v in fields.items()]
    return "\n".join(lines) + "\n\n"


class Policy:
    """The key file this scenario rewrites: the load tool's client keys, an admin key, and a probe
    key that each reload replaces."""

    def __init__(self, folder: Path):
        self.base, secrets_path = loadtool.make_keys(str(folder))
        self.path = Path(self.base)
        self.clients_file = secrets_path
        self.client_policy = self.path.read_text()
        self.admin = "sk-sf-admin-" + secrets.token_urlsafe(16)
        self.probe: tuple[str, str] | None = None
        self.write(0, malformed=False)

    def write(self, n: int, malformed: bool) -> tuple[str, str]:
        """Policy number ``n``: a new probe key; load-4's limit alternates. Returns the probe key."""
        probe = (f"probe-{n}", "sk-sf-probe-" + secrets.token_urlsafe(16))
        text = self.client_policy.replace("[keys.load-4]\n", "[keys.load-4]\n" + (
            "requests-per-minute = 6000\n" if n % 2 else ""), 1)
        text += _entry("chaos-admin", self.admin, admin=True) + _entry(*probe)
        if malformed:
            text += "[keys.broken\nsha256 = \n"
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(text)
        os.replace(tmp, self.path)
        if not malformed:
            self.probe = probe
        return probe


def run(ctx: Ctx) -> Outcome:
    p = ctx.p
    policy = Policy(ctx.out_dir / "reload-keys")
    srv = ctx.serve("--max-batch", str(p["lanes"]), "--max-context", "1024", "--key-policy", str(policy.path))
    fig: dict = {}
    out = asyncio.run(_drive(ctx, srv, policy, fig))
    fig["daemon_up"] = srv.alive()
    fig["reload_log_errors"] = sum(1 for ln in srv.log_text().splitlines()
                                   if "key" in ln.lower() and ("keeping" in ln.lower() or "error" in ln.lower()))
    ok = (out["lost"] == 0 and out["undocumented"] == 0 and fig["reloads_effective"] == fig["reloads"]
          and fig["malformed_kept_old"] == fig["malformed"] and fig["unload_load_ok"] == fig["unloads"]
          and fig["after_ok"] and fig["daemon_up"])
    fig.update(out)
    return Outcome(KEY, "superfluid", *verdict(
        ok, f"{out['requests']} requests: {out['whole']} whole, {out['documented']} documented refusals "
            f"{out['refusals']}, 0 lost; {fig['reloads']} reloads took effect (median {fig['reload_s']} s, "
            f"{fig['malformed']} malformed kept the old policy), {fig['unloads']} unload/load cycles",
        f"lost {out['lost']} {out['lost_reasons']}, undocumented {out['undocumented']} {out['undocumented_kinds']}, "
        f"reloads effective {fig['reloads_effective']}/{fig['reloads']}, malformed kept "
        f"{fig['malformed_kept_old']}/{fig['malformed']}, unload/load ok {fig['unload_load_ok']}/{fig['unloads']}, "
        f"after {fig['after_ok']}, daemon up {fig['daemon_up']}"), fig)


async def _probe(http, base: str, secret: str) -> int:
    r = await call(http, "GET", base + "/v1/models", headers={"Authorization": f"Bearer {secret}"}, timeout=10)
    return r.status


async def _faults(ctx: Ctx, srv, policy: Policy, fig: dict) -> None:
    """SIGHUPs and unload/load cycles spread over the run, never two at once."""
    p, base = ctx.p, srv.base
    admin = {"Authorization": f"Bearer {policy.admin}"}
    events = [("reload", i) for i in range(1, p["reloads"] + 1)] + [("unload", i) for i in range(p["unloads"])]
    ctx.rng.shuffle(events)
    gap = p["seconds"] * 0.9 / (len(events) + 1)
    reload_s, effective, malformed, kept, unload_ok = [], 0, 0, 0, 0
    async with aiohttp.ClientSession() as http:
        for kind, i in events:
            await asyncio.sleep(gap * ctx.rng.uniform(0.6, 1.0))
            if kind == "unload":
                un = await call(http, "POST", f"{base}/admin/models/{MODEL_NAME}/unload",
                                {"drain_timeout_s": p["drain_s"]}, headers=admin, timeout=120)
                await asyncio.sleep(gap * 0.3)
                ld = await call(http, "POST", f"{base}/admin/models/{MODEL_NAME}/load", {}, headers=admin,
                                timeout=300)
                unload_ok += un.status == 200 and ld.status == 200
                continue
            old = policy.probe
            bad = i % 10 == 7 or (p["reloads"] < 10 and i == p["reloads"] - 1)  # one malformed in ten
            new = policy.write(i, malformed=bad)
            t0 = time.monotonic()
            os.kill(srv.pid, signal.SIGHUP)
            if bad:
                malformed += 1
                await asyncio.sleep(1.0)
                kept += await _probe(http, base, old[1]) == 200 and await _probe(http, base, new[1]) == 401
                continue
            status = 0
            while time.monotonic() - t0 < 5.0:
                status = await _probe(http, base, new[1])
                if status == 200:
                    break
                await asyncio.sleep(0.05)
            took = time.monotonic() - t0
            if status == 200 and await _probe(http, base, old[1]) == 401:
                effective += 1
                reload_s.append(took)
    reload_s.sort()
    fig.update(reloads=p["reloads"] - malformed, reloads_effective=effective, malformed=malformed,
               malformed_kept_old=kept, unloads=p["unloads"], unload_load_ok=unload_ok,
               reload_s=round(reload_s[len(reload_s) // 2], 3) if reload_s else None,
               reload_max_s=round(reload_s[-1], 3) if reload_s else None)


async def _drive(ctx: Ctx, srv, policy: Policy, fig: dict) -> dict:
    p = ctx.p
    args = Namespace(target=srv.base, keys=policy.clients_file, clients=p["clients"], seconds=p["seconds"],
                     drain=60.0, model=MODEL_NAME)
    faults = asyncio.create_task(_faults(ctx, srv, policy, fig))
    report, results = await _load(args)
    await faults
    async with aiohttp.ClientSession() as http:
        after = await call(http, "POST", srv.base + "/v1/completions",
                           {"model": MODEL_NAME, "prompt": "Last:", "max_tokens": 4},
                           headers={"Authorization": f"Bearer {policy.admin}"}, timeout=120)
    fig["after_ok"] = after.status == 200
    return classify(report, results)


async def _load(args) -> tuple[dict, list]:
    results: list = []
    report = await loadtool.run(args, results)
    return report, results


def classify(report: dict, results: list) -> dict:
    whole = documented = undocumented = 0
    refusals: Counter = Counter()
    undocumented_kinds: Counter = Counter()
    for r in results:
        if r.lost is not None:
            continue
        if r.status == 200 and not r.stream_error and r.finished:
            whole += 1
        elif r.status == 200 and r.stream_error and r.code in DOCUMENTED_STREAM_ERRORS:
            documented += 1
            refusals[f"stream error {r.code}"] += 1
        elif r.status in DOCUMENTED and r.code in DOCUMENTED[r.status] and r.retry_after:
            documented += 1
            refusals[f"{r.status} {r.code}"] += 1
        else:
            undocumented += 1
            what = ("no finish_reason" if r.status == 200 and not r.stream_error
                    else f"stream error {r.code}" if r.stream_error
                    else f"{r.status} {r.code} without Retry-After" if r.code in DOCUMENTED.get(r.status, ())
                    else f"{r.status} {r.code}")
            undocumented_kinds[what] += 1
    lat = report["latency_s"]
    return {"requests": report["requests"], "whole": whole, "documented": documented, "refusals": dict(refusals),
            "lost": report["lost"], "lost_reasons": report["lost_reasons"], "undocumented": undocumented,
            "undocumented_kinds": dict(undocumented_kinds), "statuses": report["statuses"],
            "saw_model_unloaded": refusals["503 model_unloaded"] + refusals["stream error model_unloaded"],
            "latency_p50_s": round(lat["all_p50"], 3) if lat["all_p50"] else None,
            "latency_p99_s": round(lat["all_p99"], 3) if lat["all_p99"] else None}
