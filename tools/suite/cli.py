"""python -m tools.suite: pick targets and scenarios, run, print the table, write JSON and charts."""

from __future__ import annotations

import argparse
import signal
import sys
import threading
import time
from pathlib import Path

from . import chart, report, runner, targets
from .scenarios import ALL, BY_KEY


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tools.suite",
                                description="The serving-semantics scenarios of spec/benchmarks.md.")
    p.add_argument("--targets", default="superfluid,llama-server,llama-cpp-python",
                   help=f"comma-separated, from {', '.join(targets.KINDS)}; KIND=NAME renames a column")
    p.add_argument("--scenarios", default="all",
                   help=f"comma-separated keys ({', '.join(m.KEY for m in ALL)}) or 'all'")
    p.add_argument("--fast", action="store_true", help="the small workloads of the test subset")
    p.add_argument("--model", help="GGUF file (default: the default model)")
    p.add_argument("--out", default="suite-out", help="folder for suite.json, the charts and server logs")
    p.add_argument("--resume", action="store_true",
                   help="keep the outcomes already in OUT/suite.json for the scenarios and targets not run now "
                        "(finish a run that was stopped, or run one scenario again on one target); the JSON "
                        "says which came from the earlier run")
    p.add_argument("--engine", help="superfluid's engine (default: llamacpp); basert runs in-process, so "
                   "worker kill is n/a for it")
    p.add_argument("--no-qos", action="store_true",
                   help="start superfluid with --no-http-qos-header (every request in the default class); "
                        "agents + chat is expected to fail then")
    return p


def _sigterm(_signo, _frame):
    raise KeyboardInterrupt  # unwinds through run_scenario's finally, which stops the server


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _sigterm)
    kinds = []
    for spec in args.targets.split(","):
        kind, _, name = spec.strip().partition("=")
        if kind not in targets.KINDS:
            print(f"error: unknown target {kind!r} (known: {', '.join(targets.KINDS)})", file=sys.stderr)
            return 2
        kinds.append((kind, name or kind))
    if args.scenarios == "all":
        scenarios = ALL
    else:
        try:
            scenarios = [BY_KEY[k.strip()] for k in args.scenarios.split(",")]
        except KeyError as e:
            print(f"error: unknown scenario {e} (known: {', '.join(BY_KEY)})", file=sys.stderr)
            return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = args.model or targets.default_model()
    t0 = time.monotonic()
    command = "python -m tools.suite " + " ".join(argv if argv is not None else sys.argv[1:])

    kept, earlier = [], None
    if args.resume and (out / "suite.json").exists():
        previous, doc = report.read_json(out / "suite.json")
        now = {(m.KEY, name) for m in scenarios for _k, name in kinds}  # a rerun of one target keeps the others
        kept = [o for o in previous if (o.scenario, o.target) not in now]
        earlier = {"command": doc.get("command"), "date": doc.get("date"),
                   "kept": [f"{o.scenario}/{o.target}" for o in kept]}

    def meta(**more) -> dict:
        return {"command": command, "model": model, "targets": dict((n, k) for k, n in kinds),
                "fast": args.fast, "qos": not args.no_qos, "engine": args.engine or "llamacpp", "wall_s": round(time.monotonic() - t0, 1),
                **({"earlier_run": earlier} if earlier else {}), **more}

    order = {m.KEY: i for i, m in enumerate(ALL)}

    def merged(new) -> list:
        return sorted(kept + list(new), key=lambda o: order[o.scenario])  # stable: targets keep their order

    def keep_partial(so_far) -> None:  # a run stopped halfway still leaves what it measured
        report.write_json(out / "suite.json", merged(so_far), meta(partial=True))

    outcomes = merged(runner.run(scenarios, kinds, args.fast, model, out, qos=not args.no_qos,
                                 done=keep_partial, engine=args.engine))
    titles = {m.KEY: m.TITLE for m in ALL}
    names = [n for _k, n in kinds]
    charts = []
    for o in outcomes:
        if o.scenario == "agents_chat" and o not in kept:
            png = chart.timeline(o, out / f"agents_chat_{o.target}.png")
            if png:
                o.figures["chart"] = str(png)
                charts.append(str(png))
    print(report.table(outcomes, titles, names))
    print()
    print(report.figures(outcomes, titles))
    report.write_json(out / "suite.json", outcomes, meta(charts=charts))
    print(f"\nwrote {out / 'suite.json'}" + (f" and {', '.join(charts)}" if charts else ""), file=sys.stderr)
    return 0 if all(o.verdict in ("pass", "n/a") for o in outcomes) else 1
