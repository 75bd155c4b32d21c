"""Sealing's cost to the tick: how much a session turn's seal (``--park`` with ``--state-dir``)
stalls the other lanes, against the same server without sealing.

A seal copies the session's whole KV out of the pool and writes it, synced, to its park
artifact. The spec warns that this runs on the tick thread: every lane decoding beside it waits.
This measures what a neighbour sees.

The method. Two servers on the same model, started by this tool one after the other on the same
state folder kind: **sealing** (``--park --state-dir D``) and **plain** (neither). Each round, on
one server at a time:

* ``--neighbours`` streams (``/v1/completions``, ``--neighbour-tokens`` tokens, ``ignore_eos``)
  decode; the client records when each delta arrives;
* meanwhile ``--sessions`` sessions take a turn every ``--turn-interval`` seconds: a ~``--system-tokens`` system prompt and short
  replies, so each finished turn seals ~that many tokens of KV on the sealing server.

Rounds alternate between the servers (``--rounds`` each) so a noisy neighbour on the machine
hits both. Reported per server: the neighbours' inter-delta gaps (p50, p99, max; :mod:`.smoothness`)
and tokens per second, the turns taken, and on the sealing server the seals' count and mean time
(``superfluid_seal_seconds``, queued to written) and their bytes (the park artifacts' size).

    python -m tools.bench.sealing --rounds 3 --json sealing.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

from tools.suite.common import call, metric_sum, metrics, stream
from tools.suite.targets import MODEL_NAME, Server, free_port

from .smoothness import gaps, summarize

WORDS = "amber basin cedar delta ember fjord grove heron inlet juniper kelp lagoon meadow".split()


def start(model: str, flags: list[str], log: Path, pythonpath: str | None = None) -> Server:
    port = free_port()
    cmd = [sys.executable, "-m", "superfluid.core.cli", "serve", "--model", model, "--model-name", MODEL_NAME,
           "--port", str(port), *flags]
    return Server("superfluid", cmd, log, "/health", env={"PYTHONPATH": pythonpath} if pythonpath else None)


async def round_on(base: str, args, rng_tag: str) -> dict:
    async with aiohttp.ClientSession() as http:
        instants: list[list[float]] = [[] for _ in range(args.neighbours)]

        def recorder(i):
            return lambda res: instants[i].append(time.monotonic())

        system = f"[{rng_tag}] You answer in one word. Notes: " + " ".join(
            WORDS[(i * 7) % len(WORDS)] for i in range(int(args.system_tokens / 1.4)))
        done = asyncio.Event()

        async def turn(sid: str, n: int) -> None:
            t = await call(http, "POST", base + f"/v1/sessions/{sid}/turns",
                           {"messages": [{"role": "user", "content": f"Word {n}?"}], "max_tokens": 4,
                            "temperature": 0}, timeout=300)
            if t.status != 200:
                raise RuntimeError(f"turn {n}: {t.status} {t.body}")

        async def turns(sid: str) -> int:
            n = 1
            while not done.is_set() and (args.turns is None or n <= args.turns):
                t = time.monotonic()
                await turn(sid, n)
                n += 1
                await asyncio.sleep(max(0.0, args.turn_interval - (time.monotonic() - t)))
            await call(http, "DELETE", base + f"/v1/sessions/{sid}")
            return n - 1

        # each session's first turn prefills its system prompt before the measurement starts:
        # what the neighbours then share the ticks with is turns and their seals
        sids = []
        for k in range(args.sessions):
            r = await call(http, "POST", base + "/v1/sessions", {"model": MODEL_NAME, "system": f"{k} {system}"})
            sids.append(r.body["id"])
            await turn(sids[-1], 0)
        await asyncio.sleep(1.0)
        before = await metrics(http, base)

        t0 = time.monotonic()
        turn_tasks = [asyncio.create_task(turns(sid)) for sid in sids]
        streams = await asyncio.gather(*(
            stream(http, base + "/v1/completions",
                   {"model": MODEL_NAME, "prompt": f"Story {i}:", "max_tokens": args.neighbour_tokens,
                    "ignore_eos": True, "temperature": 0}, on_chunk=recorder(i), timeout=600)
            for i in range(args.neighbours)))
        wall = time.monotonic() - t0
        done.set()
        taken = sum(await asyncio.gather(*turn_tasks))
        after = await metrics(http, base)
    s = summarize([gaps(x) for x in instants])
    seals = (metric_sum(after, "superfluid_seal_seconds_count") or 0) - (
        metric_sum(before, "superfluid_seal_seconds_count") or 0)
    seal_sum = (metric_sum(after, "superfluid_seal_seconds_sum") or 0) - (
        metric_sum(before, "superfluid_seal_seconds_sum") or 0)
    return {"wall_s": round(wall, 2), "turns": taken, "errors": [x.error for x in streams if x.error],
            "tokens_per_s": round(args.neighbours * args.neighbour_tokens / wall, 1),
            "gaps": s.to_json() if s else None, "seals": seals,
            "seal_mean_s": round(seal_sum / seals, 4) if seals else None}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.bench.sealing", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="GGUF (default: the default model)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--neighbours", type=int, default=2)
    ap.add_argument("--neighbour-tokens", type=int, default=160)
    ap.add_argument("--sessions", type=int, default=2, help="sessions taking turns beside the neighbours")
    ap.add_argument("--system-tokens", type=int, default=2000)
    ap.add_argument("--turn-interval", type=float, default=1.0,
                    help="a session takes at most one turn this often (seconds), so both servers seal about as "
                         "often and the neighbours' loss compares per seal")
    ap.add_argument("--turns", type=int, metavar="N",
                    help="each session takes at most N turns a round, so both servers do the same work (by "
                         "default they take turns until the neighbours finish: a server slowed by its seals "
                         "then takes more turns in its longer round)")
    ap.add_argument("--lanes", type=int, default=4)
    ap.add_argument("--threads", type=int,
                    help="the engine's threads on both servers (default: the engine's own). With one thread on two "
                         "cores, a core is left for the seal's writer thread")
    ap.add_argument("--json", help="write every round here")
    ap.add_argument("--server-pythonpath", metavar="DIR",
                    help="run the servers from another checkout: DIR holds a 'superfluid' link to it (to compare "
                         "commits, e.g. a git worktree of the one before a change)")
    args = ap.parse_args(argv)
    if not args.model:
        from superfluid.core.default_model import default_model_path
        args.model = default_model_path()
    work = Path(tempfile.mkdtemp(prefix="sealing-bench-"))
    common = ["--max-batch", str(args.lanes), "--max-context", "4096",
              *(["--threads", str(args.threads)] if args.threads else [])]
    servers = {"sealing": start(args.model, [*common, "--park", "--state-dir", str(work / "state")],
                                work / "sealing.log", args.server_pythonpath),
               "plain": start(args.model, common, work / "plain.log", args.server_pythonpath)}
    rounds: dict[str, list[dict]] = {k: [] for k in servers}
    try:
        for r in range(args.rounds):
            for name, srv in servers.items():
                res = asyncio.run(round_on(srv.base, args, f"{name}-{r}"))
                rounds[name].append(res)
                print(f"round {r} {name}: {json.dumps(res)}", file=sys.stderr, flush=True)
        artifacts = sorted((work / "state").rglob("*.kv"))
        sizes = [a.stat().st_size for a in artifacts]
    finally:
        for srv in servers.values():
            srv.stop()
    report = {"args": vars(args), "rounds": rounds, "artifact_mb": [round(x / 2**20, 1) for x in sizes]}
    print(table(rounds, sizes))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


def table(rounds: dict[str, list[dict]], sizes: list[int]) -> str:
    def med(name, f):
        xs = [f(r) for r in rounds[name] if f(r) is not None]
        return statistics.median(xs) if xs else None

    lines = ["| server | neighbours tok/s | gap p50 ms | gap p99 ms | gap max ms | turns/round | seals/round | seal mean s |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name in rounds:
        g = lambda k: (lambda r: r["gaps"][k] * 1000 if r["gaps"] else None)  # noqa: E731
        lines.append(f"| {name} | {med(name, lambda r: r['tokens_per_s']):.1f} | {med(name, g('p50')):.0f} | "
                     f"{med(name, g('p99')):.0f} | {med(name, g('max')):.0f} | {med(name, lambda r: r['turns']):.0f} | "
                     f"{med(name, lambda r: r['seals']) or 0:.0f} | {med(name, lambda r: r['seal_mean_s']) or 0:.3f} |")
    ratios = [a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(rounds.get("sealing", []), rounds.get("plain", []))
              if b["tokens_per_s"]]
    if ratios:  # rounds run back to back, so each pair saw about the same machine: the throughput tables' method
        lines.append(f"\nNeighbours' rate, sealing / plain, round by round: median {statistics.median(ratios):.2f} "
                     f"(from {min(ratios):.2f} to {max(ratios):.2f}, {len(ratios)} rounds).")
    if sizes:
        lines.append(f"\nPark artifacts: {len(sizes)}, {statistics.median(sizes) / 2**20:.1f} MiB median.")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
