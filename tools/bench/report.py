"""Markdown tables of the results (rows targets, columns concurrencies) and the JSON file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

from tools.bench import method
from tools.bench.runner import Results


def _fmt(v: float | None, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def _paired(ratios: list[float]) -> str:
    """Median of per-round ratios and how many rounds the first target led, e.g. 0.98 (3/9)."""
    if not ratios:
        return "-"
    return f"{method.median(ratios):.2f} ({sum(r >= 1.0 for r in ratios)}/{len(ratios)})"


def _table(header: str, cols: list[int], rows: list[tuple[str, list[str]]]) -> list[str]:
    lines = [f"| {header} | " + " | ".join(str(c) for c in cols) + " |",
             "|---|" + "---:|" * len(cols)]
    lines += [f"| {name} | " + " | ".join(cells) + " |" for name, cells in rows]
    return lines


def _grid(res: Results, cell: Callable[[str, int], float | None],
          targets: list | None = None) -> dict[str, list[float | None]]:
    cs = res.settings.concurrencies
    return {t.name: [cell(t.name, c) for c in cs] for t in (res.targets if targets is None else targets)}


_GAPS = (("p50", "p50"), ("p99", "p99"), ("max", "max"), ("worst_stream_p99", "worst stream's p99"))


def _smoothness(res: Results, servers: list) -> list[str]:
    """Inter-delta gaps of the same chat streams, in ms: pooled p50, p99 and max, the worst
    stream's p99, and tokens per delta (a gap spans that many tokens on average)."""
    cs = res.settings.concurrencies
    rows: list[tuple[str, list[str]]] = []
    for t in servers:
        cells = [res.smoothness_cell(t.name, c) for c in cs]
        for key, label in _GAPS:
            rows.append((f"{t.name} {label}",
                         ["-" if m is None else f"{getattr(m, key) * 1e3:.0f}" for m in cells]))
        rows.append((f"{t.name} tokens per delta",
                     [_fmt(res.tokens_per_delta(t.name, c), ".2f") for c in cs]))
    out = ["Chat streams, smoothness: gaps between consecutive content deltas (ms), pooled over "
           "the measured streams; the worst stream's p99 is the largest of each stream's own p99", ""]
    return out + _table("target", cs, rows) + [""]


def markdown(res: Results) -> str:
    s = res.settings
    cs = s.concurrencies
    mode = "sampled (temperature 0.7, top-p 0.8, top-k 20)" if s.sampled else "greedy (temperature 0)"
    prompts = "fresh prompts each round" if s.fresh_prompts else "same prompts every round"
    out: list[str] = []
    if s.throughput and res.targets:
        grid = _grid(res, res.throughput_cell)
        out.append(f"Throughput, aggregate tok/s: {mode}, {s.max_tokens}-token replies, "
                   f"median of {s.rounds} rounds after {s.warmup} warm-up, {prompts}")
        out.append("")
        rows = [(n, [_fmt(v, ".1f") for v in vals]) for n, vals in grid.items()]
        for a, b in res.ratio_pairs():
            ratios = [method.ratio(x, y) for x, y in zip(grid[a], grid[b])]
            rows.append((f"{a} / {b}", ["-" if r is None else f"{r:.2f}x" for r in ratios]))
            rows.append((f"round by round: median (rounds {a} led)",
                         [_paired(res.round_ratios(a, b, c)) for c in cs]))
        out += _table("target", cs, rows)
        short = sum(r.short for r in res.throughput_rounds)
        if short:
            out.append("")
            out.append(f"Warning: {short} replies were shorter than max_tokens "
                       f"(a server ignored ignore_eos); those rounds did less work.")
        out.append("")
    servers = [t for t in res.targets if not t.is_bare]
    if s.ttft and servers:
        grid = _grid(res, res.ttft_cell, servers)
        out.append(f"Chat streams, median time to first content delta (s): {mode}, "
                   f"{s.ttft_max_tokens}-token replies, {s.rounds} rounds after {s.warmup} warm-up")
        out.append("")
        out += _table("target", cs, [(n, [_fmt(v, ".3f") for v in vals]) for n, vals in grid.items()])
        out.append("")
        out += _smoothness(res, servers)
    if res.error:
        out.append(f"Stopped early: {res.error}")
        out.append("")
    return "\n".join(out)


def write_json(res: Results, path: str | Path, extra: dict | None = None) -> None:
    """The results, the machine, and ``extra`` (the servers the run started, say)."""
    from tools.bench import machine

    doc = {"machine": machine.describe(), **res.to_json(), **(extra or {})}
    Path(path).write_text(json.dumps(doc, indent=2) + "\n")
