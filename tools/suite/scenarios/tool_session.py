"""200-turn tool session: one agent loop of 200 turns; the first turn is a user message, each
later turn sends only the result of the previous turn's tool call, and the model must answer with
a tool call (``tool_choice: "required"`` with the one ``step`` tool). superfluid keeps the
conversation (the session API, only the new messages are sent); peers get plain chat completions
with the whole history resent (llama-server reuses its slot's cache, cache_prompt).

200 turns outgrow an 8k context (about 57 tokens a turn here). superfluid's session then leaves
its oldest messages out of the prompt (--session-overflow truncate, the default); for the peers
the client does the same (system prompt and first message kept, the older half of the rest
dropped) when the next turn would not fit.

After the last turn, one cold request: the same conversation as the last turn's prompt, with a
fresh tag at the start of the system prompt so no cache can answer it, sent as a plain chat
completion. It costs what a server that prefills the whole history every turn pays each turn.

The curve kept in the JSON is each turn's latency (send → whole reply, non-streamed; a tool call
is one short reply, so this is first-token time plus a few decode steps), prompt tokens and
cached tokens.

Pass: all turns complete with a tool call, and the median latency of the last 20 turns is at most
a quarter of the cold request's. (Late turns still cost more than early ones: attention over an
8k history is slower than over a short one, on this CPU about 4×; the late/early ratio is kept in
the JSON. What the scenario tests is that the history is not prefilled again.)"""

from __future__ import annotations

import secrets
import time

from ..common import NotAvailable, Outcome, call, check_route, median, rnd, verdict
from ..targets import MODEL_NAME, ServeConfig

KEY, TITLE = "tool_session", "200-turn tool session"
FULL = {"turns": 200, "window": 20, "cold_fraction": 0.25, "max_tokens": 40, "lanes": 2, "context": 8192,
        "request_timeout": 300.0}
FAST = {"turns": 10, "window": 3, "cold_fraction": 0.25, "max_tokens": 40, "lanes": 2, "context": 2048,
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


def _trim(history: list[dict]) -> list[dict]:
    """The peers' client-side cut: keep the system prompt and the first user message, drop the
    older half of the rest, starting the kept part at an assistant message."""
    head, rest = history[:2], history[2:]
    starts = [i for i, m in enumerate(rest) if m["role"] == "assistant"]
    keep_from = next((i for i in starts if i >= len(rest) // 2), len(rest))
    return head + rest[keep_from:]


async def _session_window(ctx, sid) -> list[dict] | None:
    """The messages superfluid's session puts in its next prompt (system, anchor, window)."""
    r = await ctx.get(f"/v1/sessions/{sid}")
    if r.status != 200 or not isinstance(r.body, dict):
        return None
    messages, start = r.body.get("messages") or [], r.body.get("window_start") or 0
    return [{"role": "system", "content": SYSTEM}] + messages[:1] + messages[max(start, 1):]


async def _cold(ctx, p, history: list[dict]) -> float | None:
    """Latency of the conversation sent once more with nothing cached (a fresh system-prompt tag)."""
    tagged = [{"role": "system", "content": f"[run {secrets.token_hex(4)}] {SYSTEM}"}] + history[1:]
    body = {"model": MODEL_NAME, "messages": tagged, "max_tokens": p["max_tokens"], "temperature": 0,
            "tools": TOOLS, "tool_choice": CHOICE}
    if ctx.kind == "llama-server":
        body["cache_prompt"] = False
    t0 = time.monotonic()
    r = await call(ctx.http, "POST", ctx.base + "/v1/chat/completions", body, timeout=p["request_timeout"])
    return time.monotonic() - t0 if r.status == 200 else None


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
    trims = 0
    for turn in range(1, p["turns"] + 1):
        new = pending or [{"role": "user", "content": "Run the build: call step for every step."}]
        if not sessions and len(curve) >= 2 and curve[-1]["prompt_tokens"]:
            growth = curve[-1]["prompt_tokens"] - curve[-2]["prompt_tokens"]
            if curve[-1]["prompt_tokens"] + 2 * growth + p["max_tokens"] > p["context"]:
                history = _trim(history)
                trims += 1
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
    cold = None
    if last is not None:  # the last turn's conversation, prefilled from nothing
        window = await _session_window(ctx, sid) if sessions else history
        cold = await _cold(ctx, p, window) if window else None
    last_pt = curve[-1] if curve else {}
    coverage = None
    if last_pt.get("cached_tokens") is not None and last_pt.get("prompt_tokens"):
        coverage = last_pt["cached_tokens"] / last_pt["prompt_tokens"]
    figures = {"turns": p["turns"], "completed": done, "first_window_median_s": rnd(first, 4),
               "last_window_median_s": rnd(last, 4), "late_over_early": rnd(ratio, 2),
               "cold_s": rnd(cold, 3), "late_over_cold": rnd(last / cold if last and cold else None, 3),
               "cold_fraction": p["cold_fraction"], "window": w, "client_trims": trims,
               "last_prompt_tokens": last_pt.get("prompt_tokens"), "last_cached_fraction": rnd(coverage, 3),
               "failure": failure, "curve": curve}
    ok = done == p["turns"] and cold is not None and last <= p["cold_fraction"] * cold
    v, why = verdict(ok, f"{done}/{p['turns']} turns; last-{w} median {last:.3f} s = "
                     f"{last / cold:.2f}× a cold prefill's {cold:.1f} s (≤ {p['cold_fraction']})" if ok else "",
                     f"{done}/{p['turns']} turns, last-{w} median {rnd(last, 3)} s, cold {rnd(cold, 3)} s "
                     f"(allowed {p['cold_fraction']}×)" + (f"; {failure[:160]}" if failure else ""))
    return Outcome(KEY, ctx.name, v, why, figures)
