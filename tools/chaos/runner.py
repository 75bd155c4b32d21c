"""Runs chaos scenarios one after another, each with its own servers, always cleaned up."""

from __future__ import annotations

import signal
import sys
import threading
import time
import traceback
from pathlib import Path

from .common import ERROR, NA, Ctx, Outcome


def _raise_interrupt(_signo, _frame):
    raise KeyboardInterrupt  # unwinds through run_scenario's finally: servers stopped, faults undone


def run_scenario(module, fast: bool, seed: int, out_dir: Path, model: str,
                 overrides: dict | None = None) -> Outcome:
    why = module.unavailable()
    if why:
        return Outcome(module.KEY, "superfluid", NA, why)
    p = dict(module.FAST if fast else module.FULL, **(overrides or {}))
    ctx = Ctx(module.KEY, p, seed, out_dir, model, fast)
    previous = signal.signal(signal.SIGTERM, _raise_interrupt) \
        if threading.current_thread() is threading.main_thread() else None
    t0 = time.monotonic()
    try:
        out = module.run(ctx)
    except Exception as e:  # the run broke: say so, keep going with the rest
        out = Outcome(module.KEY, "superfluid", ERROR, f"{type(e).__name__}: {e}"[:500],
                      {"traceback": traceback.format_exc()[-3000:]})
    finally:
        ctx.close()
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    out.seconds = time.monotonic() - t0
    out.figures.setdefault("params", p)
    out.figures.setdefault("seed", seed)
    return out


def run(scenarios: list, fast: bool, seed: int, out_dir: Path, model: str, done=None) -> list[Outcome]:
    outcomes = []
    for module in scenarios:
        print(f"== {module.TITLE} ...", file=sys.stderr, flush=True)
        o = run_scenario(module, fast, seed, out_dir, model)
        print(f"   {o.verdict}: {o.reason} ({o.seconds:.0f} s)", file=sys.stderr, flush=True)
        outcomes.append(o)
        if done is not None:
            done(outcomes)
    return outcomes
