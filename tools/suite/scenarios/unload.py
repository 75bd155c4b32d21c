"""Unload under traffic: clients keep sending chat requests (streamed and not) while the model is
unloaded (POST /admin/models/{name}/unload {"drain_timeout_s": 2}) and loaded again
(POST /admin/models/{name}/load).

Pass: both admin calls answer 200; no client hangs (every request ends within the bound); every
request either succeeds or gets a clear error (an OpenAI error body or stream error event; 503s
while unloaded carry code model_unloaded and a Retry-After header); at least one request saw the
model unloaded; the server stays up; after the reload a request succeeds."""

from __future__ import annotations

import asyncio
import time

from ..common import FAIL, Outcome, call, check_route, stream, verdict
from ..targets import MODEL_NAME, ServeConfig

KEY, TITLE = "unload", "unload under traffic"
FULL = {"clients": 8, "duration": 14.0, "unload_at": 4.0, "load_at": 8.0, "drain": 2.0, "max_tokens": 48,
        "bound": 60.0, "lanes": 8, "context": 2048}
# FAST: the same three phases (served, unloaded, reloaded), each as short as still leaves traffic in it
FAST = {"clients": 3, "duration": 4.0, "unload_at": 1.0, "load_at": 2.5, "drain": 1.0, "max_tokens": 24,
        "bound": 30.0, "lanes": 2, "context": 1024}


def unsupported(kind):
    return None if kind == "superfluid" else "no API to unload and reload a model while serving"


def config(kind, p, state_dir) -> ServeConfig:
    return ServeConfig(lanes=p["lanes"], context=p["context"])


def _code(body):
    return body.get("error", {}).get("code") if isinstance(body, dict) and isinstance(body.get("error"), dict) else None


async def _client(ctx, p, k, t0, log):
    i = 0
    while time.monotonic() - t0 < p["duration"]:
        i += 1
        body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": f"Count to {k + i}."}],
                "max_tokens": p["max_tokens"], "temperature": 0}
        sent = time.monotonic()
        rec = {"client": k, "sent": round(sent - t0, 3), "stream": i % 2 == 0}
        try:
            if rec["stream"]:
                r = await stream(ctx.http, f"{ctx.base}/v1/chat/completions", body, timeout=p["bound"])
                rec.update(status=r.status, code=_code(r.body), error=r.error,
                           clear=(r.status == 200 and r.error is None)
                           or (r.status != 200 and _code(r.body) is not None)
                           or (r.error or "").startswith("stream error"))
                retry = None
            else:
                r = await call(ctx.http, "POST", f"{ctx.base}/v1/chat/completions", body, timeout=p["bound"])
                retry = r.headers.get("Retry-After")
                rec.update(status=r.status, code=_code(r.body), error=None if r.status == 200 else str(r.body)[:200],
                           clear=r.status == 200 or _code(r.body) is not None)
            rec["retry_after"] = retry
            if rec.get("code") == "model_unloaded" and not rec["stream"] and retry is None:
                rec["clear"] = False  # a 503 model_unloaded must say when to retry
        except (asyncio.TimeoutError, TimeoutError):
            rec.update(status=None, error="hung: no answer within the bound", clear=False, hung=True)
        except Exception as e:
            rec.update(status=None, error=f"{type(e).__name__}: {e}"[:200], clear=False)
        rec["seconds"] = round(time.monotonic() - sent, 3)
        log.append(rec)
        if rec.get("status") == 503:
            await asyncio.sleep(0.3)


async def run(ctx) -> Outcome:
    p = ctx.p
    t0 = time.monotonic()
    log: list[dict] = []
    clients = [asyncio.create_task(_client(ctx, p, k, t0, log)) for k in range(p["clients"])]
    await asyncio.sleep(p["unload_at"])
    un = await call(ctx.http, "POST", f"{ctx.base}/admin/models/{MODEL_NAME}/unload",
                    {"drain_timeout_s": p["drain"]}, timeout=p["bound"])
    un_at = time.monotonic() - t0
    try:
        check_route(un.status, un.body, "POST /admin/models/{name}/unload")
    except Exception:
        for c in clients:
            c.cancel()
        await asyncio.gather(*clients, return_exceptions=True)
        raise
    await asyncio.sleep(max(0.0, p["load_at"] - (time.monotonic() - t0)))
    ld = await call(ctx.http, "POST", f"{ctx.base}/admin/models/{MODEL_NAME}/load", {}, timeout=300)
    ld_at = time.monotonic() - t0
    await asyncio.gather(*clients)
    final = await call(ctx.http, "POST", f"{ctx.base}/v1/chat/completions",
                       {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8},
                       timeout=p["bound"])
    ok_n = sum(1 for r in log if r.get("status") == 200 and not r.get("error"))
    unloaded_n = sum(1 for r in log if r.get("code") == "model_unloaded")
    unclear = [r for r in log if not r.get("clear")]
    hung = [r for r in log if r.get("hung")]
    figures = {"requests": len(log), "succeeded": ok_n, "saw_model_unloaded": unloaded_n,
               "unclear_errors": len(unclear), "hung": len(hung), "unload_status": un.status,
               "unload_returned_at_s": round(un_at, 2), "load_status": ld.status,
               "load_returned_at_s": round(ld_at, 2), "after_reload_status": final.status,
               "alive_after": ctx.server.alive(), "max_request_s": max((r["seconds"] for r in log), default=None),
               "examples_unclear": unclear[:3], "codes": sorted({str(r.get("code")) for r in log})}
    if un.status != 200 or ld.status != 200:
        return Outcome(KEY, ctx.name, FAIL, f"unload → {un.status}, load → {ld.status}", figures)
    ok = not unclear and not hung and unloaded_n > 0 and final.status == 200 and ctx.server.alive()
    v, why = verdict(ok, f"{len(log)} requests: {ok_n} ok, {unloaded_n} clear 503s while unloaded; "
                     "reload served", f"{len(unclear)} unclear errors, {len(hung)} hung, "
                     f"{unloaded_n} saw model_unloaded, after reload HTTP {final.status}")
    return Outcome(KEY, ctx.name, v, why, figures)
