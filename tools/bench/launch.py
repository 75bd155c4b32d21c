"""Targets the bench starts itself: ``NAME=KIND:MODEL.gguf`` instead of ``NAME=BASE_URL``.

    python -m tools.bench --target superfluid-mlx=superfluid-mlx:$M --target mlx_lm.server=mlx-lm:$M

KIND is one of the suite's targets (tools/suite/targets.py), started the way the suite starts
them, on a free loopback port, from the same GGUF:

* ``superfluid`` — ``superfluid serve --max-batch L --max-context C`` (llama.cpp engine);
* ``superfluid-mlx`` — the same with ``--engine mlx``;
* ``llama-server`` — ``llama-server -np L -c L×C`` (tools/bench/build_llama_server.sh);
* ``llama-cpp-python`` — ``python -m llama_cpp.server --n_ctx C`` (one request at a time);
* ``mlx-lm`` — ``python -m mlx_lm server`` with L decoding at once, on the GGUF converted once
  to an mlx-lm directory in the cache (tools/suite/mlx_lm_dir.py).

Each answers to the model name ``smollm2`` (``--model`` is for URL targets). Every server
is started before the first round and stopped (SIGTERM, then SIGKILL of its process group)
when the run ends, however it ends; the kernel kills any left if the bench itself is killed
(superfluid.core.lifeline). Their logs go to ``--logs``.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from tools.suite import targets as suite_targets

KINDS = suite_targets.KINDS
MODEL_NAME = suite_targets.MODEL_NAME


def parse(base: str) -> tuple[str, str] | None:
    """``KIND:MODEL.gguf`` -> (KIND, MODEL.gguf); None for a URL or a bare-loop address."""
    kind, sep, model = base.partition(":")
    if sep and kind in KINDS and model and not model.startswith("//"):
        return kind, model
    return None


@dataclass
class Launched:
    name: str
    kind: str
    model_path: str
    server: suite_targets.Server

    @property
    def base(self) -> str:
        return self.server.base

    def to_json(self) -> dict:
        return {"kind": self.kind, "model": self.model_path, "base": self.base, "pid": self.server.pid,
                "command": self.server.cmd, "log": str(self.server.log_path)}


def add_target_options(ap, timeout: float, context_help: str = "cells a lane (started targets)") -> None:
    """The options a tool shares with every other that starts ``KIND:MODEL`` targets or reaches
    URL ones: their lanes' context, the model name, the request timeout, where their logs go."""
    ap.add_argument("--context", type=int, default=4096, help=context_help)
    ap.add_argument("--model", help="model name for URL targets (default: the first listed)")
    ap.add_argument("--timeout", type=float, default=timeout)
    ap.add_argument("--logs", default="test-artifacts/bench-logs", help="started servers' logs")


def start_all(pairs: list[tuple[str, str]], lanes: int, context: int, log_dir: Path,
              progress=lambda line: print(line, file=sys.stderr, flush=True)) -> list[Launched]:
    """Start a server for every ``KIND:MODEL`` target, one after the other (so no load overlaps a
    start). On a failure the ones already started are stopped before the error propagates."""
    log_dir.mkdir(parents=True, exist_ok=True)
    started: list[Launched] = []
    try:
        for name, base in pairs:
            spec = parse(base)
            if spec is None:
                continue
            kind, model = spec
            cfg = suite_targets.ServeConfig(lanes=lanes, context=context)
            log = log_dir / f"{name.replace('/', '_')}.log"
            log.write_bytes(b"")
            progress(f"{name}: starting {kind} on {model} (log {log})")
            started.append(Launched(name, kind, model, suite_targets.start(kind, cfg, log, model)))
            progress(f"{name}: {kind} ready at {started[-1].base}, pid {started[-1].server.pid}")
    except BaseException:
        stop_all(started)
        raise
    return started


def stop_all(started: list[Launched]) -> None:
    for s in reversed(started):
        s.server.stop()
