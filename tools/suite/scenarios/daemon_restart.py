"""Daemon restart: a conversation of a few turns over a long system prompt, then SIGTERM, a
restart on the same state, and one more turn.

superfluid: the session API (``--state-dir DIR --park``): the session's turns must survive the
restart (GET /v1/sessions/{id} shows them) and the next turn must reuse the parked KV.
Peers keep no conversation, so the client resends the history; each uses its own persistence:
llama-server saves slot 0 before the stop and restores it after (``--slot-save-path``),
llama-cpp-python its disk prompt cache (``--cache true --cache_type disk``).

Pass: the server stops by itself within 30 s of SIGTERM (exit status 0, or the signal's own
termination — it is not SIGKILLed; superfluid exits 0), the turns survive, and the first turn after the
restart prefills at most 25 % of its prompt (prompt tokens − cached tokens; superfluid reads
usage.prompt_tokens_details.cached_tokens, llama-server ``timings.prompt_n``, llama-cpp-python the
``prompt eval … tokens`` line of its log)."""

from __future__ import annotations

import signal

from ..common import FAIL, Outcome, check_route, verdict
from ..targets import MODEL_NAME, ServeConfig, logged_prefill_tokens

KEY, TITLE = "daemon_restart", "daemon restart"
FULL = {"system_sentences": 70, "turns": 3, "max_tokens": 32, "context": 4096, "lanes": 4,
        "max_prefill_fraction": 0.25, "exit_timeout": 30.0}
FAST = {"system_sentences": 25, "turns": 2, "max_tokens": 16, "context": 2048, "lanes": 2,
        "max_prefill_fraction": 0.25, "exit_timeout": 30.0}
SENTENCE = ("Rule {i}: the operator on shift {i} checks pump {i}, logs its pressure and reports "
            "anything above the limit to the duty engineer. ")
QUESTIONS = ["Who checks pump 3?", "What is logged for pump 7?", "Who gets the reports?",
             "Which shift checks pump 12?", "What happens above the limit?"]


def unsupported(kind):
    return None


def config(kind, p, state_dir) -> ServeConfig:
    return ServeConfig(lanes=p["lanes"], context=p["context"], park=True, state_dir=state_dir)


def _system(p):
    return "You answer questions about the plant rules.\n" + "".join(
        SENTENCE.format(i=i) for i in range(p["system_sentences"]))


def _cached(usage) -> int | None:
    if not isinstance(usage, dict):
        return None
    det = usage.get("prompt_tokens_details") or {}
    return det.get("cached_tokens")


async def _terminate(ctx, p):
    rc, secs = ctx.server.terminate(p["exit_timeout"])
    return rc, secs


async def run(ctx) -> Outcome:
    return await (_run_superfluid(ctx) if ctx.kind == "superfluid" else _run_peer(ctx))


async def _run_superfluid(ctx) -> Outcome:
    p = ctx.p
    r = await ctx.post("/v1/sessions", {"system": _system(p), "qos": "agent"})
    check_route(r.status, r.body, "POST /v1/sessions")
    if r.status != 201:
        return Outcome(KEY, ctx.name, FAIL, f"POST /v1/sessions: HTTP {r.status} {str(r.body)[:200]}")
    sid = r.body["id"]
    turn = {"max_tokens": p["max_tokens"], "temperature": 0}
    before = []
    for q in QUESTIONS[:p["turns"]]:
        r = await ctx.post(f"/v1/sessions/{sid}/turns", {**turn, "messages": [{"role": "user", "content": q}]})
        check_route(r.status, r.body, "POST /v1/sessions/{id}/turns")
        if r.status != 200:
            return Outcome(KEY, ctx.name, FAIL, f"turn before the restart: HTTP {r.status} {str(r.body)[:200]}")
        before.append(r.body.get("usage"))
    rc, secs = await _terminate(ctx, p)
    ctx.server.start()
    r = await ctx.get(f"/v1/sessions/{sid}")
    turns_after = r.body.get("turns") if r.status == 200 and isinstance(r.body, dict) else None
    r = await ctx.post(f"/v1/sessions/{sid}/turns",
                       {**turn, "messages": [{"role": "user", "content": QUESTIONS[p["turns"]]}]})
    usage = r.body.get("usage") if r.status == 200 and isinstance(r.body, dict) else None
    prompt = (usage or {}).get("prompt_tokens")
    cached = _cached(usage)
    return _judge(ctx, p, rc, secs, turns_after == p["turns"], prompt, cached, usage_before=before,
                  extra={"session": sid, "turns_after_restart": turns_after, "next_turn_status": r.status})


async def _run_peer(ctx) -> Outcome:
    p = ctx.p
    messages = [{"role": "system", "content": _system(p)}]
    slot = {"id_slot": 0, "cache_prompt": True} if ctx.kind == "llama-server" else {}
    for q in QUESTIONS[:p["turns"]]:
        messages.append({"role": "user", "content": q})
        r = await ctx.post("/v1/chat/completions", {"model": MODEL_NAME, "messages": messages,
                                                    "max_tokens": p["max_tokens"], "temperature": 0, **slot})
        if r.status != 200:
            return Outcome(KEY, ctx.name, FAIL, f"turn before the restart: HTTP {r.status} {str(r.body)[:200]}")
        messages.append({"role": "assistant", "content": r.body["choices"][0]["message"].get("content") or ""})
    saved = None
    if ctx.kind == "llama-server":
        s = await ctx.post("/slots/0?action=save", {"filename": "suite-session.bin"})
        saved = s.status
    rc, secs = await _terminate(ctx, p)
    ctx.server.start()
    restored = None
    if ctx.kind == "llama-server":
        s = await ctx.post("/slots/0?action=restore", {"filename": "suite-session.bin"})
        restored = s.status
    log_before = logged_prefill_tokens(ctx.server.log_text())
    messages.append({"role": "user", "content": QUESTIONS[p["turns"]]})
    r = await ctx.post("/v1/chat/completions", {"model": MODEL_NAME, "messages": messages,
                                                "max_tokens": p["max_tokens"], "temperature": 0, **slot})
    body = r.body if isinstance(r.body, dict) else {}
    prompt = (body.get("usage") or {}).get("prompt_tokens")
    cached = _cached(body.get("usage"))
    timings = body.get("timings") or {}
    if ctx.kind == "llama-server" and prompt is not None and "prompt_n" in timings:
        cached = prompt - timings["prompt_n"]
    elif cached is None and prompt is not None:
        logged = logged_prefill_tokens(ctx.server.log_text()) - log_before
        cached = prompt - logged if logged else None
    return _judge(ctx, p, rc, secs, True, prompt, cached,
                  extra={"history": "held by the client", "slot_save": saved, "slot_restore": restored,
                         "next_turn_status": r.status})


def _judge(ctx, p, rc, secs, survived, prompt, cached, extra, usage_before=None) -> Outcome:
    prefilled = None if prompt is None or cached is None else prompt - cached
    fraction = None if prefilled is None or not prompt else prefilled / prompt
    figures = {"exit_code": rc, "exit_seconds": round(secs, 2), "turns_survived": survived,
               "next_turn_prompt_tokens": prompt, "next_turn_cached_tokens": cached,
               "next_turn_prefilled_tokens": prefilled, "prefilled_fraction": fraction,
               "usage_before_restart": usage_before, **extra}
    clean = rc == 0 or (rc == -signal.SIGTERM and ctx.kind != "superfluid")
    ok = (clean and survived and fraction is not None and cached > 0
          and fraction <= p["max_prefill_fraction"])
    v, why = verdict(ok, f"clean exit in {secs:.1f} s; next turn prefilled {prefilled} of {prompt} tokens",
                     f"exit code {rc} in {secs:.1f} s, turns survived={survived}, next turn prefilled "
                     f"{prefilled} of {prompt} tokens (allowed {p['max_prefill_fraction']:.0%})")
    return Outcome(KEY, ctx.name, v, why, figures)
