"""The arithmetic and the round order of the method, kept free of I/O so it is testable.

Throughput of a round is the sum of usage.completion_tokens over the wall time from
the first send to the last response; a cell is the median over measured rounds after
discarding warm-up rounds. Targets are interleaved round by round so thermal drift
hits all of them alike.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Iterator, Sequence


@dataclass(frozen=True)
class Step:
    """One round of one target at one concurrency."""

    concurrency: int
    round: int  # 0-based, counting warm-up rounds
    warmup: bool
    target: str


def schedule(
    targets: Sequence[str], concurrencies: Sequence[int], rounds: int, warmup: int = 1
) -> Iterator[Step]:
    """Round-by-round interleaving: at each concurrency, round r of every target
    (in the order given) before round r+1 of any."""
    if rounds < 1:
        raise ValueError("rounds must be >= 1")
    if warmup < 0:
        raise ValueError("warmup must be >= 0")
    for c in concurrencies:
        for r in range(warmup + rounds):
            for t in targets:
                yield Step(concurrency=c, round=r, warmup=r < warmup, target=t)


def throughput(completion_tokens: Sequence[int], first_send: float, last_response: float) -> float:
    """Aggregate tokens per second of one round."""
    wall = last_response - first_send
    if wall <= 0:
        raise ValueError(f"non-positive wall time {wall!r}")
    return sum(completion_tokens) / wall


def median(values: Sequence[float]) -> float | None:
    """Median of the values, or None when there are none."""
    return statistics.median(values) if values else None


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b, or None when either is missing or b is zero."""
    if a is None or b is None or b == 0:
        return None
    return a / b


def parse_concurrencies(text: str) -> list[int]:
    """'1,2,4,8' -> [1, 2, 4, 8]; each must be a positive integer."""
    out = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        n = int(part)
        if n < 1:
            raise ValueError(f"concurrency must be >= 1, got {n}")
        out.append(n)
    if not out:
        raise ValueError("no concurrency given")
    return out


def parse_target(text: str) -> tuple[str, str]:
    """'NAME=BASE_URL' -> (NAME, BASE_URL without trailing slash)."""
    name, sep, url = text.partition("=")
    if not sep or not name.strip() or not url.strip():
        raise ValueError(f"target must be NAME=BASE_URL, got {text!r}")
    url = url.strip().rstrip("/")
    if url.endswith("/v1"):
        url = url[:-3]
    return name.strip(), url
