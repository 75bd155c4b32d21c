"""200-turn tool session: one agent loop of 200 turns; the first turn is a user message, each
later turn sends only the result of the previous turn's tool call, and the model must answer with
a tool call
(``tool_choice: "required"`` with the one ``step`` tool). superfluid keeps the conversation (the session API, only
the new messages are sent); peers get plain chat completions with the whole history resent
(llama-server reuses its slot's cache, cache_prompt).

The curve kept in the JSON is each turn's latency (send → whole reply, non-streamed; a tool call
is one short reply, so this is first-token time plus a few decode steps), prompt tokens and
cached tokens.

Pass: all turns complete with a tool call, and the median latency of the last 20 turns is at most
k = 3 times the median of the first 20 (a server that prefilled the whole history every turn
would grow with it)."""

from __future__ import annotations

import time

from ..common import NotAvailable, Outcome, call, check_route, median, rnd, verdict
from ..targets import MODEL_NAME, ServeConfig

KEY, TITLE = "tool_session", "200-turn tool session"
FULL = {"turns": 200, "window": 20, "k": 3.0, "max_tokens": 40, "lanes": 2, "context": 8192,
        "request_timeout": 300.0}
FAST = {"turns": 10, "window": 3, "k": 3.0, "max_tokens": 40, "lanes": 2, "context": 2048,
        "request_timeout": 120.0}
SYSTEM = "You are a build agent. Call the step tool once per message with the step number you are given."
TOOLS = [{"type": "function", "function": {
    "name": "step", "description": "Run one build step.",
    "parameters": {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}}}]
CHOICE = "required"  # one tool, so the same as naming it; every peer knows "required"


def unsupported(kind):
    return None


def config(kind, p, state_dir) -> ServeConfig:
    return ServeConfig(lanes=p["lanes"], context=p["context"])


def _cached(body):
    usage = body.get("usage") or {}
    det = usage.get("prompt_tokens_details") or {}
    if det.get("cached_tokens") is not None:
        return det["cached_tokens"]
    t = body.get("timings") or {}
    return t.get("cache_n")


async def run(ctx) -> Outcome:
    p = ctx.p
    sessions = ctx.kind == "superfluid"
    sid = None
    if sessions:
        r = await ctx.post("/v1/sessions", {"system": SYSTEM, "qos": "agent"})
        check_route(r.status, r.body, "POST /v1/sessions")
        sid = r.body["id"]
    history = [{"role": "system", "content": SYSTEM}]
    pending: list[dict] = []
    curve = []
    failure = None
    for turn in range(1, p["turns"] + 1):
        new = pending or [{"role": "user", "content": "Run the build: call step for every step."}]
        body = {"messages": new if sessions else history + new, "max_tokens": p["max_tokens"],
                "temperature": 0, "tools": TOOLS, "tool_choice": CHOICE}
        if not sessions:
            body["model"] = MODEL_NAME
            if ctx.kind == "llama-server":
                body["cache_prompt"] = True
        path = f"/v1/sessions/{sid}/turns" if sessions else "/v1/chat/completions"
        t0 = time.monotonic()
        r = await call(ctx.http, "POST", ctx.base + path, body, timeout=p["request_timeout"])
        latency = time.monotonic() - t0
        check_route(r.status, r.body, "POST " + path.replace(str(sid), "{id}"))
        err = r.body.get("error") if isinstance(r.body, dict) else None
        if r.status == 400 and isinstance(err, dict) and err.get("param") in ("tools", "tool_choice"):
            raise NotAvailable(f"not available: tool calls ({err.get('code')}: {err.get('message')})")
        b = r.body if isinstance(r.body, dict) else {}
        calls = ((b.get("choices") or [{}])[0].get("message") or {}).get("tool_calls") or []
        point = {"turn": turn, "latency_s": round(latency, 4), "status": r.status,
                 "prompt_tokens": (b.get("usage") or {}).get("prompt_tokens"), "cached_tokens": _cached(b),
                 "tool_calls": len(calls)}
        curve.append(point)
        if r.status != 200 or not calls:
            failure = f"turn {turn}: HTTP {r.status}, {len(calls)} tool calls: {str(r.body)[:300]}"
            break
        tc = calls[0]
        history += new + [{"role": "assistant", "content": None, "tool_calls": calls}]
        pending = [{"role": "tool", "tool_call_id": tc.get("id") or f"call_{turn}",
                    "content": f"ok {turn}"}]
    done = sum(1 for c in curve if c["status"] == 200 and c["tool_calls"])
    w = p["window"]
    first = median([c["latency_s"] for c in curve[:w]])
    last = median([c["latency_s"] for c in curve[-w:]]) if done == p["turns"] else None
    ratio = None if first is None or last is None else last / first
    last_pt = curve[-1] if curve else {}
    coverage = None
    if last_pt.get("cached_tokens") is not None and last_pt.get("prompt_tokens"):
        coverage = last_pt["cached_tokens"] / last_pt["prompt_tokens"]
    figures = {"turns": p["turns"], "completed": done, "first_window_median_s": rnd(first, 4),
               "last_window_median_s": rnd(last, 4), "ratio": rnd(ratio, 2), "k": p["k"], "window": w,
               "last_prompt_tokens": last_pt.get("prompt_tokens"), "last_cached_fraction": rnd(coverage, 3),
               "failure": failure, "curve": curve}
    ok = done == p["turns"] and ratio is not None and ratio <= p["k"]
    v, why = verdict(ok, f"{done}/{p['turns']} turns; last-{w} median {last:.3f} s vs first-{w} "
                     f"{first:.3f} s ({ratio:.2f}x ≤ {p['k']}x)" if ok else "",
                     f"{done}/{p['turns']} turns, ratio {rnd(ratio, 2)} (k={p['k']})"
                     + (f"; {failure[:160]}" if failure else ""))
    return Outcome(KEY, ctx.name, v, why, figures)
