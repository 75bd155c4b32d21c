"""Runs scenarios against targets: a fresh server per (scenario, target), always stopped."""

from __future__ import annotations

import asyncio
import signal
import sys
import threading
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from . import targets
from .common import ERROR, NA, NotAvailable, Outcome, Reply, Unsupported, call
from .scenarios import ALL


@dataclass
class Ctx:
    """What a scenario gets: the target's name and kind, its server, parameters, an HTTP session."""
    name: str
    kind: str
    server: targets.Server
    p: dict[str, Any]
    http: aiohttp.ClientSession
    out_dir: Path

    @property
    def base(self) -> str:
        return self.server.base

    async def get(self, path: str, timeout: float = 30.0) -> Reply:
        return await call(self.http, "GET", self.base + path, timeout=timeout)

    async def post(self, path: str, body: Any = None, timeout: float = 600.0) -> Reply:
        return await call(self.http, "POST", self.base + path, body, timeout=timeout)


def _raise_interrupt(_signo, _frame):
    raise KeyboardInterrupt


def _catch_sigterm():
    """While a server runs, SIGTERM unwinds (so the server is stopped) instead of killing us."""
    if threading.current_thread() is not threading.main_thread():
        return None
    return signal.signal(signal.SIGTERM, _raise_interrupt)


def _log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


async def _run_one(module, kind, name, p, server, out_dir) -> Outcome:
    conn = aiohttp.TCPConnector(limit=0, force_close=True)
    async with aiohttp.ClientSession(connector=conn) as http:
        return await module.run(Ctx(name, kind, server, p, http, out_dir))


def run_scenario(module, kind: str, name: str, fast: bool, model: str, out_dir: Path,
                 qos: bool = True, overrides: dict | None = None, engine: str | None = None) -> Outcome:
    """One scenario against one target, on a server of its own."""
    p = dict(module.FAST if fast else module.FULL, **(overrides or {}))
    seen_as = targets.family(kind)  # superfluid on MLX runs superfluid's scenario code
    why = module.unsupported(seen_as)
    if why:
        return Outcome(module.KEY, name, NA, why)
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix=f"suite-{module.KEY}-") as state:
        cfg = module.config(seen_as, p, state)
        cfg.qos = qos
        if engine and kind == "superfluid":
            cfg.extra += ["--engine", engine]
        log_path = out_dir / "logs" / f"{module.KEY}-{name}.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        log_path.write_bytes(b"")
        server = None
        previous = _catch_sigterm()
        try:
            server = targets.start(kind, cfg, log_path, model)
            out = asyncio.run(_run_one(module, seen_as, name, p, server, out_dir))
        except NotAvailable as e:
            out = Outcome(module.KEY, name, ERROR, str(e))
        except Unsupported as e:
            out = Outcome(module.KEY, name, NA, str(e))
        except Exception as e:  # the run broke: say so, keep going with the rest
            out = Outcome(module.KEY, name, ERROR, f"{type(e).__name__}: {e}"[:500],
                          {"traceback": traceback.format_exc()[-3000:]})
        finally:
            if server is not None:
                server.stop()
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)
    out.seconds = time.monotonic() - t0
    out.figures.setdefault("params", p)
    out.figures["server_log"] = str(log_path)
    return out


def run(scenarios: list, kinds: list[tuple[str, str]], fast: bool, model: str, out_dir: Path,
        qos: bool = True, overrides: dict | None = None, progress=_log, done=None,
        engine: str | None = None) -> list[Outcome]:
    """Every scenario against every target; targets take turns within a scenario. ``done`` gets
    the outcomes so far after each one (the CLI keeps suite.json current with it)."""
    outcomes = []
    for module in scenarios:
        for kind, name in kinds:
            progress(f"== {module.TITLE} on {name} ...")
            o = run_scenario(module, kind, name, fast, model, out_dir, qos, overrides, engine)
            progress(f"   {o.verdict}: {o.reason} ({o.seconds:.0f} s)")
            outcomes.append(o)
            if done is not None:
                done(outcomes)
    return outcomes


__all__ = ["ALL", "Ctx", "run", "run_scenario"]
