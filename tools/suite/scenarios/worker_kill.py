"""Worker kill: SIGKILL the engine worker while 8 greedy streams are decoding.

Pass: every stream completes (HTTP 200, no error event) and each text equals the text of an
undisturbed run of the same 8 requests."""

from __future__ import annotations

import asyncio
import os
import signal

from ..common import ERROR, Outcome, Unsupported, stream, verdict
from ..targets import MODEL_NAME, ServeConfig

KEY, TITLE = "worker_kill", "worker kill"
FULL = {"streams": 8, "max_tokens": 120, "kill_after_chunks": 10, "lanes": 8, "context": 2048}
FAST = {"streams": 4, "max_tokens": 120, "kill_after_chunks": 4, "lanes": 4, "context": 1024}
TOPICS = ["volcanoes", "the moon", "bees", "trains", "rivers", "chess", "clouds", "bread", "maps",
          "glass", "salt", "owls", "kites", "tides", "ink", "wool"]


def unsupported(kind: str) -> str | None:
    return None if kind == "superfluid" else "one process: no engine worker to kill apart from the server"


def config(kind, p, state_dir) -> ServeConfig:
    return ServeConfig(lanes=p["lanes"], context=p["context"])


def _prompt(i: int) -> str:
    return (f"<|im_start|>user\nTell me about topic number {i}: {TOPICS[i % len(TOPICS)]}.<|im_end|>\n"
            "<|im_start|>assistant\n")


async def _round(ctx, on_chunk=None):
    body = lambda i: {"model": MODEL_NAME, "prompt": _prompt(i), "max_tokens": ctx.p["max_tokens"],  # noqa: E731
                      "temperature": 0, "ignore_eos": True}
    return await asyncio.gather(*[stream(ctx.http, f"{ctx.base}/v1/completions", body(i), on_chunk=on_chunk)
                                  for i in range(ctx.p["streams"])])


async def run(ctx) -> Outcome:
    p = ctx.p
    health = (await ctx.get("/health")).body
    model = health["models"][MODEL_NAME]
    pid = model.get("worker_pid") or model.get("pid")
    if pid is None:  # basert runs in the daemon's own process
        raise Unsupported(f"engine {model.get('engine', '?')} runs in-process: no engine worker to kill")
    reference = await _round(ctx)
    if any(r.error for r in reference):
        return Outcome(KEY, ctx.name, ERROR, f"undisturbed run failed: {[r.error for r in reference if r.error][0]}")
    restarts0 = model.get("restarts", 0)
    progress = {"chunks": 0}
    killed = asyncio.Event()

    def on_chunk(_res):
        progress["chunks"] += 1
        if not killed.is_set() and progress["chunks"] >= p["streams"] * p["kill_after_chunks"]:
            os.kill(pid, signal.SIGKILL)
            killed.set()

    disturbed = await _round(ctx, on_chunk)
    health = (await ctx.get("/health")).body["models"][MODEL_NAME]
    completed = sum(1 for r in disturbed if r.status == 200 and not r.error)
    identical = sum(1 for a, b in zip(reference, disturbed) if a.text == b.text and not b.error)
    figures = {"streams": p["streams"], "killed_pid": pid, "killed": killed.is_set(),
               "completed": completed, "identical_to_undisturbed": identical,
               "restarts": health.get("restarts", 0) - restarts0, "new_pid": health.get("worker_pid"),
               "errors": [r.error for r in disturbed if r.error][:3]}
    # The kill must have landed mid-generation: the server restarted the worker (a kill after the
    # last token would leave nothing to recover and prove nothing).
    restarted = figures["restarts"] >= 1
    ok = killed.is_set() and restarted and completed == p["streams"] and identical == p["streams"]
    v, why = verdict(ok, f"{completed}/{p['streams']} completed, {identical} identical after the kill, "
                         f"worker restarted",
                     f"killed={killed.is_set()}, restarted={restarted}, {completed}/{p['streams']} completed, "
                     f"{identical}/{p['streams']} identical to the undisturbed run")
    return Outcome(KEY, ctx.name, v, why, figures)
