"""Runs the schedule: one round of N concurrent requests at a time, against each
target in turn, and keeps every round's raw numbers.

Rounds never overlap, so one target's round never loads the machine while another's
is being timed.
"""

from __future__ import annotations

import asyncio
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Sequence

import aiohttp

from tools.bench import bare, client, method, prompts, smoothness


@dataclass(frozen=True)
class Target:
    name: str
    base: str  # a server's base URL, or llamacpp:MODEL.gguf for the bare runtime loop
    model: str | None = None

    @property
    def is_bare(self) -> bool:
        return bare.is_bare(self.base)


@dataclass
class Settings:
    concurrencies: list[int]
    rounds: int = 3
    warmup: int = 1
    max_tokens: int = 256
    ttft_max_tokens: int = 32
    sampled: bool = False
    fresh_prompts: bool = True
    request_timeout: float = 600.0
    connect_timeout: float = 10.0
    api_key: str | None = None
    throughput: bool = True
    ttft: bool = True
    bare_threads: int | None = None  # engine threads of a bare target (default: its own)
    bare_context: int = 4096  # KV cells per sequence of a bare target
    bare_extra_buffers: str = "auto"  # llama.cpp's extra buffer types in a bare target (auto, on, off)

    @property
    def sampling(self) -> dict[str, Any]:
        return dict(client.SAMPLED if self.sampled else client.GREEDY)


@dataclass
class ThroughputRound:
    target: str
    concurrency: int
    round: int
    warmup: bool
    completion_tokens: list[int]
    wall_s: float
    tok_s: float
    short: int  # replies with fewer than max_tokens tokens (ignore_eos not honoured)


@dataclass
class TtftRound:
    target: str
    concurrency: int
    round: int
    warmup: bool
    ttft_s: list[float | None]
    wall_s: float
    gaps_s: list[list[float]] = field(default_factory=list)  # per stream: seconds between its deltas
    deltas: list[int] = field(default_factory=list)  # per stream: content deltas received
    completion_tokens: list[int | None] = field(default_factory=list)  # per stream: usage, if sent


@dataclass
class Results:
    targets: list[Target]
    settings: Settings
    throughput_rounds: list[ThroughputRound] = field(default_factory=list)
    ttft_rounds: list[TtftRound] = field(default_factory=list)
    error: str | None = None

    def throughput_cell(self, target: str, concurrency: int) -> float | None:
        """Median tok/s over the measured (non-warm-up) rounds."""
        return method.median(
            [r.tok_s for r in self.throughput_rounds
             if r.target == target and r.concurrency == concurrency and not r.warmup]
        )

    def round_ratios(self, first: str, other: str, concurrency: int) -> list[float]:
        """first / other tok/s, round by round over the measured rounds both ran. The two
        servers of a round run back to back, so a pair shares the machine's phase; the
        spread of these ratios shows how far a ratio of medians can be trusted."""
        def by_round(target: str) -> dict[int, float]:
            return {r.round: r.tok_s for r in self.throughput_rounds
                    if r.target == target and r.concurrency == concurrency and not r.warmup}
        a, b = by_round(first), by_round(other)
        return [a[n] / b[n] for n in sorted(a) if n in b and b[n] > 0]

    def ratio_pairs(self) -> list[tuple[str, str]]:
        """The first target against each other one, and every other server against each
        bare loop (the ceiling), so each server's share of the runtime's speed shows."""
        names = [t.name for t in self.targets]
        bares = [t.name for t in self.targets if t.is_bare]
        return [(names[0], n) for n in names[1:]] + [
            (t.name, b) for t in self.targets[1:] if not t.is_bare for b in bares]

    def ttft_cell(self, target: str, concurrency: int) -> float | None:
        """Median first-token time over every stream of the measured rounds."""
        return method.median(
            [t for r in self.ttft_rounds
             if r.target == target and r.concurrency == concurrency and not r.warmup
             for t in r.ttft_s if t is not None]
        )

    def smoothness_cell(self, target: str, concurrency: int) -> smoothness.Smoothness | None:
        """Inter-delta gaps pooled over every stream of the measured rounds, with the worst
        stream's p99 beside them."""
        return smoothness.summarize(
            [g for r in self.ttft_rounds
             if r.target == target and r.concurrency == concurrency and not r.warmup
             for g in r.gaps_s]
        )

    def tokens_per_delta(self, target: str, concurrency: int) -> float | None:
        """usage.completion_tokens over content deltas, over the measured streams that reported
        usage: 1.0 when every delta is one token, more when a server sends tokens in lumps
        (then a gap spans several tokens)."""
        pairs = [(t, d) for r in self.ttft_rounds
                 if r.target == target and r.concurrency == concurrency and not r.warmup
                 for t, d in zip(r.completion_tokens, r.deltas) if t is not None and d > 0]
        return sum(t for t, _ in pairs) / sum(d for _, d in pairs) if pairs else None

    def to_json(self) -> dict[str, Any]:
        names = [t.name for t in self.targets]
        cs = self.settings.concurrencies
        return {
            "settings": asdict(self.settings) | {"sampling": self.settings.sampling, "api_key": None},
            "targets": [asdict(t) for t in self.targets],
            "throughput_tok_s": {n: {str(c): self.throughput_cell(n, c) for c in cs} for n in names},
            "round_ratios": {f"{a}/{b}": {str(c): self.round_ratios(a, b, c) for c in cs}
                             for a, b in self.ratio_pairs()},
            "ttft_s": {n: {str(c): self.ttft_cell(n, c) for c in cs} for n in names},
            "smoothness_s": {n: {str(c): _as_json(self.smoothness_cell(n, c)) for c in cs} for n in names},
            "tokens_per_delta": {n: {str(c): self.tokens_per_delta(n, c) for c in cs} for n in names},
            "throughput_rounds": [asdict(r) for r in self.throughput_rounds],
            "ttft_rounds": [asdict(r) for r in self.ttft_rounds],
            "error": self.error,
        }


def _as_json(cell: smoothness.Smoothness | None) -> dict | None:
    return None if cell is None else cell.to_json()


async def _all(coros) -> list:
    """Run the requests of one round together; if one fails, cancel the rest."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


def _tag(kind: str, step: method.Step, fresh: bool) -> str | None:
    # Same tag for every target at one step, so they all get the same prompts.
    return f"{kind}{step.concurrency}r{step.round}" if fresh else None


async def throughput_round(
    session: aiohttp.ClientSession, target: Target, step: method.Step, s: Settings
) -> ThroughputRound:
    """N concurrent fixed-length completions with N distinct prompts."""
    batch = prompts.completion_prompts(step.concurrency, _tag("t", step, s.fresh_prompts))
    sampling = s.sampling
    first_send = time.perf_counter()
    done = await _all(
        client.complete(session, target.base, target.model or "", p, s.max_tokens,
                        sampling, s.request_timeout)
        for p in batch
    )
    return _throughput_record(target, step, s, [d.completion_tokens for d in done],
                              first_send, max(d.done for d in done))


def _throughput_record(target: Target, step: method.Step, s: Settings, tokens: list[int],
                       first_send: float, last_response: float) -> ThroughputRound:
    return ThroughputRound(
        target=target.name, concurrency=step.concurrency, round=step.round,
        warmup=step.warmup, completion_tokens=tokens,
        wall_s=last_response - first_send,
        tok_s=method.throughput(tokens, first_send, last_response),
        short=sum(1 for t in tokens if t < s.max_tokens),
    )


async def bare_throughput_round(
    loop: bare.BareTarget, target: Target, step: method.Step, s: Settings
) -> ThroughputRound:
    """The same prompts and reply length as a server's round, run by the bare loop."""
    batch = prompts.completion_prompts(step.concurrency, _tag("t", step, s.fresh_prompts))
    first_send = time.perf_counter()
    reply = await loop.run(batch, s.max_tokens, s.request_timeout)
    return _throughput_record(target, step, s, [int(n) for n in reply["completion_tokens"]],
                              first_send, time.perf_counter())


async def ttft_round(
    session: aiohttp.ClientSession, target: Target, step: method.Step, s: Settings
) -> TtftRound:
    """N concurrent chat streams, each timed to its first content delta and to every delta after."""
    texts = prompts.user_texts(step.concurrency, _tag("s", step, s.fresh_prompts))
    sampling = s.sampling
    start = time.perf_counter()
    done = await _all(
        client.stream_ttft(session, target.base, target.model or "", t, s.ttft_max_tokens,
                           sampling, s.request_timeout)
        for t in texts
    )
    return TtftRound(
        target=target.name, concurrency=step.concurrency, round=step.round,
        warmup=step.warmup, ttft_s=[d.ttft for d in done],
        wall_s=max(d.done for d in done) - start,
        gaps_s=[smoothness.gaps(d.deltas) for d in done],
        deltas=[len(d.deltas) for d in done],
        completion_tokens=[d.completion_tokens for d in done],
    )


def _session(s: Settings) -> aiohttp.ClientSession:
    limit = max(s.concurrencies)
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=limit, limit_per_host=limit),
        headers=client.headers(s.api_key),
        timeout=aiohttp.ClientTimeout(total=s.request_timeout, sock_connect=s.connect_timeout),
    )


Progress = Callable[[str], None]


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


async def run(targets: Sequence[Target], s: Settings, progress: Progress = _stderr) -> Results:
    """Resolve models, then run the throughput and the TTFT schedules.

    A failed request stops the run; what was measured so far is kept and the
    error is recorded in the results.
    """
    sessions = {t.name: _session(s) for t in targets if not t.is_bare}
    loops: dict[str, bare.BareTarget] = {}
    resolved: list[Target] = []
    results = Results(targets=resolved, settings=s)
    try:
        for t in targets:
            if t.is_bare:
                loops[t.name] = bare.BareTarget(bare.model_path(t.base), max(s.concurrencies),
                                                s.bare_context, s.bare_threads, s.bare_extra_buffers)
                await loops[t.name].start()
                model = loops[t.name].model
            else:
                model = t.model or await client.first_model(
                    sessions[t.name], t.base, s.connect_timeout + 20.0)
            resolved.append(Target(t.name, t.base, model))
            progress(f"{t.name}: {t.base} model={model}")
        by_name = {t.name: t for t in resolved}
        names = [t.name for t in resolved]

        async def throughput(step: method.Step) -> ThroughputRound:
            if step.target in loops:
                return await bare_throughput_round(loops[step.target], by_name[step.target], step, s)
            return await throughput_round(sessions[step.target], by_name[step.target], step, s)

        async def ttft(step: method.Step) -> TtftRound:
            return await ttft_round(sessions[step.target], by_name[step.target], step, s)

        phases = []
        if s.throughput:
            phases.append(("throughput", throughput, names, results.throughput_rounds))
        if s.ttft:  # the bare loop has no chat template and no stream: servers only
            phases.append(("ttft", ttft, [n for n in names if n not in loops], results.ttft_rounds))
        for phase, fn, phase_names, sink in phases:
            for step in method.schedule(phase_names, s.concurrencies, s.rounds, s.warmup):
                rec = await fn(step)
                sink.append(rec)
                progress(_describe(phase, rec))
    except (client.BenchError, bare.BareError, aiohttp.ClientError, asyncio.TimeoutError) as e:
        results.error = f"{type(e).__name__}: {e}"
        progress(f"error: {results.error}")
    finally:
        for sess in sessions.values():
            await sess.close()
        for loop in loops.values():
            await loop.close()
    return results


def _describe(phase: str, rec: ThroughputRound | TtftRound) -> str:
    kind = "warm-up" if rec.warmup else "round"
    head = f"{phase} c={rec.concurrency} {kind} {rec.round} {rec.target}:"
    if isinstance(rec, ThroughputRound):
        extra = f" ({rec.short} short replies)" if rec.short else ""
        return (f"{head} {sum(rec.completion_tokens)} tok in {rec.wall_s:.2f} s = "
                f"{rec.tok_s:.1f} tok/s{extra}")
    got = [t for t in rec.ttft_s if t is not None]
    med = method.median(got)
    if med is None:
        return f"{head} no content"
    gaps = smoothness.summarize(rec.gaps_s)
    extra = f", gaps p50 {gaps.p50 * 1e3:.0f} ms max {gaps.max * 1e3:.0f} ms" if gaps else ""
    return f"{head} median ttft {med:.3f} s{extra}"
