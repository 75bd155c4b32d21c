"""Watching costs nothing: throughput of a fixed workload with no /events readers against ten.

    python -m tools.bench.watchers --json watchers.json

One superfluid server (started here on a free loopback port with the default model, or
``--target URL``). A round is a fixed, bounded workload: ``--concurrency`` completions of
``--max-tokens`` tokens each (``ignore_eos``, temperature 0, one prompt), timed from the first
request to the last reply; its throughput is completion tokens over that wall time. Rounds
alternate A (no reader) and B (``--readers`` open /events streams at ``--interval-ms``, of which
``--stalled`` are sockets that never read, behind a tiny receive buffer), A B A B ..., after a warm-up
round, so drift on a shared machine falls on both alike. The readers are connected before a B round
starts and closed after it.

Reported: each round's tokens/s, the median per mode, and the ratio B / A of the medians (the goal:
at least 0.99), also per adjacent pair (their median is the figure least moved by a neighbour's
burst on a shared machine), over the quiet pairs only (neither round below 80 % of the run's best)
and best against best; the snapshots the reading watchers got, how many
were coalesced, the CPU time of the server's own process per second in each mode (where the hub
runs; the engine worker is a process of its own), also with no requests at all (the readers' own
cost, free of the workload's noise), and the load average before and after. A JSON report (``--json``) and a markdown table on stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

PROMPT = "<|im_start|>user\nWrite a long story about a lighthouse keeper.<|im_end|>\n<|im_start|>assistant\n"


async def one(session: aiohttp.ClientSession, base: str, model: str, max_tokens: int) -> int:
    body = {"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    async with session.post(f"{base}/v1/completions", json=body) as r:
        data = await r.json()
        if r.status != 200:
            raise RuntimeError(f"{r.status}: {data}")
        return data["usage"]["completion_tokens"]


async def workload(session, base: str, model: str, concurrency: int, max_tokens: int) -> dict:
    start = time.perf_counter()
    tokens = await asyncio.gather(*(one(session, base, model, max_tokens) for _ in range(concurrency)))
    wall = time.perf_counter() - start
    return {"tokens": sum(tokens), "seconds": round(wall, 3), "tokens_per_s": round(sum(tokens) / wall, 2)}


QUIET = 0.8
COALESCED = re.compile(rb'"coalesced":(\d+)')


class Watchers:
    """``readers`` open /events streams. The reading ones read raw chunks and count snapshots
    (and what was coalesced) without parsing the JSON, so the bench's own CPU, on the same
    machine as the server, stays out of the measurement as far as it can."""

    def __init__(self, base: str, readers: int, stalled: int, interval_ms: int):
        self.base, self.readers, self.stalled, self.interval_ms = base, readers, stalled, interval_ms
        self.snapshots = self.coalesced = 0
        self._tasks: list[asyncio.Task] = []
        self._socks: list[socket.socket] = []
        self.host, port = base.split("//")[1].rsplit(":", 1)
        self.port = int(port)

    def _request(self) -> bytes:
        return f"GET /events?interval_ms={self.interval_ms} HTTP/1.1\r\nHost: {self.host}\r\n\r\n".encode()

    async def _read(self, ready: asyncio.Event):
        reader, writer = await asyncio.open_connection(self.host, self.port)
        try:
            writer.write(self._request())
            head = await reader.readuntil(b"\r\n\r\n")
            if not head.startswith(b"HTTP/1.1 200"):
                raise RuntimeError(f"/events: {head[:200]!r}")
            ready.set()
            pending = b""
            while True:
                chunk = await reader.read(65536)
                if not chunk:
                    return
                pending += chunk
                cut = pending.rfind(b"\n\n")  # count whole events only
                if cut < 0:
                    continue
                whole, pending = pending[:cut + 2], pending[cut + 2:]
                self.snapshots += whole.count(b"event: snapshot\n")
                self.coalesced += sum(int(m) for m in COALESCED.findall(whole))
        finally:
            writer.close()

    def _stall(self) -> socket.socket:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
        sock.connect((self.host, self.port))
        sock.sendall(self._request())
        return sock

    async def __aenter__(self):
        readies = []
        for _ in range(self.readers - self.stalled):
            ready = asyncio.Event()
            readies.append(ready)
            self._tasks.append(asyncio.create_task(self._read(ready)))
        self._socks = [self._stall() for _ in range(self.stalled)]
        await asyncio.wait_for(asyncio.gather(*(r.wait() for r in readies)), 30)
        await asyncio.sleep(self.interval_ms / 1000 * 2)  # every reader has had its first snapshots
        return self

    async def __aexit__(self, *exc):
        for task in self._tasks:
            task.cancel()
        results = await asyncio.gather(*self._tasks, return_exceptions=True)
        for sock in self._socks:
            sock.close()
        for r in results:
            if isinstance(r, Exception) and not isinstance(r, asyncio.CancelledError):
                raise r


def _loadavg(before: str | None = None) -> dict:
    """The machine's load averages before and after (a shared machine's noise shows here)."""
    try:
        now = Path("/proc/loadavg").read_text().split()[:3]
    except OSError:
        now = None
    return {"before": before, "after": " ".join(now) if now else None}


def _cpu_s(pid: int | None) -> float | None:
    """CPU seconds (user + system) the server's own process has used: its event loop, the
    scheduler threads and the /events hub; not the engine worker, a process of its own."""
    if pid is None:
        return None
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def run(args, base: str, pid: int | None = None) -> dict:
    start_load = _loadavg()["after"]
    rounds: list[dict] = []
    seen = {"snapshots": 0, "coalesced": 0}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=args.timeout)) as session:
        async with session.get(f"{base}/v1/models") as r:
            model = args.model_name or (await r.json())["data"][0]["id"]
        await workload(session, base, model, args.concurrency, args.max_tokens)  # warm-up, not counted
        idle = {}
        if pid is not None:  # what the readers alone cost the server's process, with nothing else running
            for mode in "AB":
                for _ in range(2):
                    if mode == "A":
                        cpu, t0 = _cpu_s(pid), time.perf_counter()
                        await asyncio.sleep(args.idle_s)
                    else:
                        async with Watchers(base, args.readers, args.stalled, args.interval_ms):
                            cpu, t0 = _cpu_s(pid), time.perf_counter()
                            await asyncio.sleep(args.idle_s)
                    idle.setdefault(mode, []).append(round((_cpu_s(pid) - cpu) * 1000 / (time.perf_counter() - t0), 2))
        for i in range(args.rounds * 2):
            mode = "A" if i % 2 == 0 else "B"
            if mode == "A":
                cpu = _cpu_s(pid)
                result = await workload(session, base, model, args.concurrency, args.max_tokens)
            else:
                async with Watchers(base, args.readers, args.stalled, args.interval_ms) as w:
                    cpu = _cpu_s(pid)
                    result = await workload(session, base, model, args.concurrency, args.max_tokens)
                seen["snapshots"] += w.snapshots
                seen["coalesced"] += w.coalesced
            if cpu is not None:
                result["server_cpu_ms_per_s"] = round((_cpu_s(pid) - cpu) * 1000 / result["seconds"], 1)
            rounds.append({"round": i, "mode": mode, **result})
            print(f"round {i} {mode}: {result['tokens_per_s']} tok/s", file=sys.stderr, flush=True)
    a = [r["tokens_per_s"] for r in rounds if r["mode"] == "A"]
    b = [r["tokens_per_s"] for r in rounds if r["mode"] == "B"]
    pairs = [round(rb / ra, 4) for ra, rb in zip(a, b)]
    # a pair is quiet when neither round fell below QUIET of the best round of the run: a burst
    # from another process on a shared machine hits one round of a pair, and says nothing of watching
    best = max(a + b)
    quiet = [round(rb / ra, 4) for ra, rb in zip(a, b) if min(ra, rb) >= QUIET * best]
    return {"loadavg": _loadavg(start_load),
            "settings": {"concurrency": args.concurrency, "max_tokens": args.max_tokens, "rounds": args.rounds,
                         "readers": args.readers, "stalled": args.stalled, "interval_ms": args.interval_ms,
                         "max_batch": args.max_batch},
            "rounds": rounds, "median_A": statistics.median(a), "median_B": statistics.median(b),
            "ratio": round(statistics.median(b) / statistics.median(a), 4), "pair_ratios": pairs,
            "median_pair_ratio": statistics.median(pairs), "best_ratio": round(max(b) / max(a), 4),
            "quiet_pair_ratios": quiet, "median_quiet_pair_ratio": statistics.median(quiet) if quiet else None,
            "server_cpu_ms_per_s": {mode: _median([r.get("server_cpu_ms_per_s") for r in rounds if r["mode"] == mode])
                                    for mode in "AB"},
            "idle_server_cpu_ms_per_s": idle, "watchers": seen}


def _median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def table(report: dict) -> str:
    s = report["settings"]
    rows = [f"{s['concurrency']} concurrent requests × {s['max_tokens']} tokens, {s['rounds']} rounds per mode "
            f"interleaved; B: {s['readers']} /events readers at {s['interval_ms']} ms ({s['stalled']} stalled)", "",
            "| mode | tokens/s per round | median |", "|---|---|---:|"]
    for mode, label in (("A", "A: no readers"), ("B", f"B: {s['readers']} readers")):
        values = [r["tokens_per_s"] for r in report["rounds"] if r["mode"] == mode]
        rows.append(f"| {label} | {', '.join(f'{v:.1f}' for v in values)} | {report['median_' + mode]:.1f} |")
    rows.append(f"| **ratio B / A** (medians) | pairs: {', '.join(f'{p:.3f}' for p in report['pair_ratios'])} "
                f"| **{report['ratio']:.3f}** |")
    rows.append(f"| median of the pair ratios | | {report['median_pair_ratio']:.3f} |")
    rows.append(f"| best B / best A | | {report['best_ratio']:.3f} |")
    if report.get("median_quiet_pair_ratio") is not None:
        rows.append(f"| median of the quiet pairs (both rounds ≥ {QUIET:.0%} of the best round) | "
                    f"{len(report['quiet_pair_ratios'])} pairs: {', '.join(f'{p:.3f}' for p in report['quiet_pair_ratios'])} "
                    f"| {report['median_quiet_pair_ratio']:.3f} |")
    cpu = report.get("server_cpu_ms_per_s") or {}
    if cpu.get("A") is not None:
        rows.append(f"| server process CPU (event loop, scheduler, hub; not the engine worker), ms per s | "
                    f"A {cpu['A']:.1f}, B {cpu['B']:.1f} | +{cpu['B'] - cpu['A']:.1f} |")
    idle = report.get("idle_server_cpu_ms_per_s") or {}
    if idle:
        rows.append(f"| server process CPU with no requests, ms per s ({s['readers']} readers against none) | "
                    f"A {idle['A']}, B {idle['B']} | +{min(idle['B']) - min(idle['A']):.2f} |")
    w = report["watchers"]
    load = report.get("loadavg") or {}
    rows += ["", f"The reading watchers got {w['snapshots']} snapshots, {w['coalesced']} coalesced. "
             f"Load average before / after: {load.get('before')} / {load.get('after')}."]
    return "\n".join(rows)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m tools.bench.watchers", description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", metavar="BASE_URL", help="a running server (without a key policy) instead of one started here")
    ap.add_argument("--model", help="GGUF to serve (default: superfluid's default model)")
    ap.add_argument("--model-name", help="model id to call (default: the first listed)")
    ap.add_argument("--max-batch", type=int, default=8, help="the started server's --max-batch")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=8, help="rounds per mode")
    ap.add_argument("--readers", type=int, default=10)
    ap.add_argument("--stalled", type=int, default=2, help="of --readers, sockets that never read")
    ap.add_argument("--interval-ms", type=int, default=100, help="the readers' interval (100: the busiest allowed)")
    ap.add_argument("--idle-s", type=float, default=5.0, help="seconds of each idle CPU measurement")
    ap.add_argument("--timeout", type=float, default=600.0, help="per request")
    ap.add_argument("--json", metavar="PATH")
    return ap


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    if not 0 <= args.stalled <= args.readers:
        print("--stalled must be from 0 to --readers", file=sys.stderr)
        return 2
    server = None
    try:
        if args.target:
            base = args.target.rstrip("/")
        else:
            from tools.suite.targets import ServeConfig, default_model, start
            workdir = Path(tempfile.mkdtemp(prefix="bench-watchers-"))
            server = start("superfluid", ServeConfig(lanes=args.max_batch, context=2048),
                           workdir / "server.log", args.model or default_model())
            base = server.base
        report = asyncio.run(run(args, base, server.proc.pid if server is not None else None))
    finally:
        if server is not None:
            server.stop()
    report["date"] = time.strftime("%Y-%m-%d")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    print(table(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
