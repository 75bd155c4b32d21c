"""Stream smoothness: how evenly a chat stream's text arrives, from the gaps between its deltas.

First-token time says when a reader starts reading; the gaps say whether the text then flows
or stutters. A server that batches lanes into long ticks, or stalls every stream while it
prefills a newcomer, shows it here and nowhere else: the throughput can be the same.

A *gap* is the time between two consecutive content deltas of one stream, as the client
receives them (the first gap starts at the first delta; the wait before it is the first-token
time, measured apart). Gaps are per delta, not per token: a delta that carries several tokens
is one gap, because that is what a reader sees (the text arrives in a lump). The JSON keeps
each stream's delta count beside its ``usage.completion_tokens`` so a server that sends
several tokens per delta shows it (tokens per delta > 1).

Pure arithmetic, no I/O: the percentiles are nearest-rank (the smallest gap with at least q
of the gaps at or below it), so every figure is a gap that was measured, and p99 of fewer
than 100 gaps is the largest or next-to-largest.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Sequence


def gaps(instants: Sequence[float]) -> list[float]:
    """Consecutive differences of one stream's delta arrival instants (seconds, in order)."""
    return [b - a for a, b in zip(instants, instants[1:])]


def percentile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile, ``q`` in [0, 1]; None when there are no values."""
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"q must be in [0, 1], got {q!r}")
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(q * len(ordered)))
    return ordered[rank - 1]


@dataclass(frozen=True)
class Smoothness:
    """The gaps of a set of streams (one target at one concurrency), in seconds."""

    p50: float
    p99: float
    max: float
    worst_stream_p99: float  # the largest of the streams' own p99: one stream's stutter, not diluted
    gaps: int  # gaps pooled
    streams: int  # streams with at least one gap

    def to_json(self) -> dict:
        return asdict(self)


def summarize(streams: Sequence[Sequence[float]]) -> Smoothness | None:
    """Pool the gaps of every stream (each a list of gaps); None when no stream has a gap
    (every stream ended after at most one delta)."""
    measured = [list(s) for s in streams if s]
    pooled = [g for s in measured for g in s]
    if not pooled:
        return None
    return Smoothness(
        p50=percentile(pooled, 0.50), p99=percentile(pooled, 0.99), max=max(pooled),
        worst_stream_p99=max(percentile(s, 0.99) for s in measured),
        gaps=len(pooled), streams=len(measured),
    )
