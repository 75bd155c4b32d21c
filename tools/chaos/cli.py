"""python -m tools.chaos: run the fault scenarios, print the table, write chaos.json."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from . import report, runner
from .scenarios import ALL, BY_KEY


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tools.chaos",
                                description="Faults on purpose: disks, processes, networks, clients.")
    p.add_argument("--scenarios", default="all",
                   help=f"comma-separated keys ({', '.join(m.KEY for m in ALL)}) or 'all'")
    p.add_argument("--fast", action="store_true", help="the CI variant's small, short workloads")
    p.add_argument("--seed", type=int, default=1, help="seeds every random choice (kill moments, clients)")
    p.add_argument("--model", help="GGUF file (default: the default model)")
    p.add_argument("--out", default="chaos-out", help="folder for chaos.json, charts and server logs")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.scenarios == "all":
        scenarios = ALL
    else:
        try:
            scenarios = [BY_KEY[k.strip()] for k in args.scenarios.split(",")]
        except KeyError as e:
            print(f"error: unknown scenario {e} (known: {', '.join(BY_KEY)})", file=sys.stderr)
            return 2
    if args.model:
        model = args.model
    else:
        from superfluid.core.default_model import default_model_path
        model = default_model_path()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"command": " ".join(["python -m tools.chaos", *(argv if argv is not None else sys.argv[1:])]),
            "seed": args.seed, "fast": args.fast}
    outcomes = runner.run(scenarios, args.fast, args.seed, out, model,
                          done=lambda os_: report.write_json(out / "chaos.json", os_, meta))
    print(report.table(outcomes, BY_KEY))
    return 0 if all(o.verdict in ("pass", "n/a") for o in outcomes) else 1
