"""Command line: parse targets and settings, run, print tables, write JSON."""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
import tempfile
import threading
from pathlib import Path

from tools.bench import bare, launch, machine, method, report
from tools.bench.runner import Settings, Target, run


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m tools.bench",
        description="Throughput and TTFT of OpenAI-compatible servers, measured the way "
                    "spec/benchmarks.md says ('How to measure').",
    )
    p.add_argument("--target", action="append", required=True, metavar="NAME=BASE_URL",
                   help="a server to measure; repeat to compare (the first is the ratio's "
                        "numerator); rounds interleave across targets. NAME=llamacpp:MODEL.gguf "
                        "is the bare llama.cpp loop with no server, the ceiling for servers "
                        "on the same build (throughput only, greedy only). NAME=KIND:MODEL.gguf "
                        f"starts that server for the run and stops it after; KIND is one of "
                        f"{', '.join(launch.KINDS)}")
    p.add_argument("--concurrency", default="1,2,4,8", metavar="N,N,...",
                   help="concurrent requests per round (default 1,2,4,8)")
    p.add_argument("--rounds", type=int, default=3, help="measured rounds; the median is reported (default 3)")
    p.add_argument("--warmup", type=int, default=1,
                   help="rounds discarded first at each concurrency (default 1)")
    p.add_argument("--max-tokens", type=int, default=256, help="reply length, with ignore_eos (default 256)")
    p.add_argument("--sampled", action="store_true",
                   help="temperature 0.7, top-p 0.8, top-k 20 instead of greedy")
    p.add_argument("--model", help="model field for every request (default: first id of GET /v1/models)")
    p.add_argument("--ttft-max-tokens", type=int, default=32,
                   help="reply length of the TTFT chat streams (default 32)")
    p.add_argument("--skip-ttft", action="store_true", help="throughput only")
    p.add_argument("--skip-throughput", action="store_true", help="TTFT only")
    p.add_argument("--same-prompts", action="store_true",
                   help="reuse the same prompts every round (default: a fresh tag per round, "
                        "so no prefix cache answers)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request (default 600)")
    p.add_argument("--connect-timeout", type=float, default=10.0, help="seconds to connect (default 10)")
    p.add_argument("--api-key", help="sent as 'Authorization: Bearer KEY'")
    p.add_argument("--bare-threads", type=int, metavar="N",
                   help="engine threads of a llamacpp: target (default: the CPU count, at most 8)")
    p.add_argument("--bare-context", type=int, default=4096, metavar="CELLS",
                   help="KV cells per sequence of a llamacpp: target (default 4096)")
    p.add_argument("--bare-extra-buffers", choices=("auto", "on", "off"), default="auto",
                   help="llama.cpp's extra buffer types (AMX, CPU repacking) in a llamacpp: target, "
                        "decided as the server's --llama-extra-buffers (default auto)")
    p.add_argument("--lanes", type=int, default=8, metavar="L",
                   help="lanes of a server started by a KIND:MODEL target (default 8)")
    p.add_argument("--context", type=int, default=4096, metavar="C",
                   help="context per lane of a server started by a KIND:MODEL target (default 4096)")
    p.add_argument("--logs", metavar="DIR", help="logs of the servers started by KIND:MODEL targets "
                   "(default: a new temporary folder, printed)")
    p.add_argument("--json", metavar="PATH", help="write all rounds and medians as JSON")
    p.add_argument("--quiet", action="store_true", help="no per-round progress on stderr")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        pairs = [method.parse_target(t) for t in args.target]
        concurrencies = method.parse_concurrencies(args.concurrency)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    names = [n for n, _ in pairs]
    if len(set(names)) != len(names):
        print("error: target names must be distinct", file=sys.stderr)
        return 2
    if args.rounds < 1 or args.warmup < 0 or args.max_tokens < 1 or args.ttft_max_tokens < 1:
        print("error: --rounds and --max-tokens must be >= 1, --warmup >= 0", file=sys.stderr)
        return 2
    has_bare = any(bare.is_bare(u) for _, u in pairs)
    if has_bare and args.sampled:
        print("error: a llamacpp: target decodes greedily; drop --sampled", file=sys.stderr)
        return 2
    if (args.bare_threads is not None and args.bare_threads < 1) or args.bare_context < 1:
        print("error: --bare-threads and --bare-context must be >= 1", file=sys.stderr)
        return 2
    if args.skip_ttft and args.skip_throughput:
        print("error: nothing to run", file=sys.stderr)
        return 2
    settings = Settings(
        concurrencies=concurrencies, rounds=args.rounds, warmup=args.warmup,
        max_tokens=args.max_tokens, ttft_max_tokens=args.ttft_max_tokens,
        sampled=args.sampled, fresh_prompts=not args.same_prompts,
        request_timeout=args.timeout, connect_timeout=args.connect_timeout,
        api_key=args.api_key, throughput=not args.skip_throughput, ttft=not args.skip_ttft,
        bare_threads=args.bare_threads, bare_context=args.bare_context,
        bare_extra_buffers=args.bare_extra_buffers,
    )
    if args.lanes < 1 or args.context < 1:
        print("error: --lanes and --context must be >= 1", file=sys.stderr)
        return 2
    progress = (lambda _line: None) if args.quiet else None
    previous = _catch_sigterm()
    started: list[launch.Launched] = []
    try:
        if any(launch.parse(u) for _, u in pairs):
            logs = Path(args.logs or tempfile.mkdtemp(prefix="bench-logs-"))
            started = launch.start_all(pairs, args.lanes, args.context, logs,
                                       **({"progress": progress} if progress else {}))
        by_name = {s.name: s for s in started}
        targets = [Target(n, by_name[n].base, launch.MODEL_NAME) if n in by_name else Target(n, u, args.model)
                   for n, u in pairs]
        results = asyncio.run(run(targets, settings, progress) if progress else run(targets, settings))
    finally:
        launch.stop_all(started)
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    print(machine.line())
    print()
    print(report.markdown(results))
    if args.json:
        report.write_json(results, args.json, {"launched": {s.name: s.to_json() for s in started}})
    return 1 if results.error else 0


def _interrupt(_signo, _frame):
    raise KeyboardInterrupt


def _catch_sigterm():
    """SIGTERM unwinds through main's finally, so the servers it started are stopped cleanly
    (if the bench is SIGKILLed instead, the kernel kills them: lifeline)."""
    if threading.current_thread() is not threading.main_thread():
        return None
    return signal.signal(signal.SIGTERM, _interrupt)
