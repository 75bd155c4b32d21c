"""Per-key counts for ``GET /events``: requests, tokens and rejections per key name, counted
beside the Prometheus metrics (:class:`TeeMetrics` passes every call on to them), so a snapshot
reads three integers per key instead of scraping the registry."""

from __future__ import annotations

from typing import Iterable


class KeyTally:
    """Per key name: generations admitted, tokens charged, requests refused by the key's limits.

    Fed by the key limiter (it calls the same methods on :data:`~..info.metrics.METRICS`; a
    :class:`TeeMetrics` gives it both), on the event loop."""

    def __init__(self) -> None:
        self.counts: dict[str, list[int]] = {}

    def _of(self, key: str) -> list[int]:
        found = self.counts.get(key)
        if found is None:
            found = self.counts[key] = [0, 0, 0]
        return found

    def key_admitted(self, key: str) -> None:
        self._of(key)[0] += 1

    def key_finished(self, key: str, prompt_tokens: int, completion_tokens: int) -> None:
        self._of(key)[1] += prompt_tokens + completion_tokens

    def key_rejected(self, key: str, reason: str) -> None:
        self._of(key)[2] += 1

    def view(self, names: Iterable[str]) -> dict:
        """Every key of the policy (zeros included), then any other name counted."""
        names = list(names)
        known = set(names)
        out = {}
        for name in names + [n for n in self.counts if n not in known]:
            requests, tokens, rejections = self.counts.get(name, (0, 0, 0))
            out[name] = {"requests": requests, "tokens": tokens, "rejections": rejections}
        return out


class TeeMetrics:
    """The metrics object the key limiter reports to: the Prometheus metrics and the tally."""

    def __init__(self, metrics, tally: KeyTally):
        self._metrics, self._tally = metrics, tally

    def key_admitted(self, key: str) -> None:
        self._metrics.key_admitted(key)
        self._tally.key_admitted(key)

    def key_finished(self, key: str, prompt_tokens: int, completion_tokens: int) -> None:
        self._metrics.key_finished(key, prompt_tokens, completion_tokens)
        self._tally.key_finished(key, prompt_tokens, completion_tokens)

    def key_rejected(self, key: str, reason: str) -> None:
        self._metrics.key_rejected(key, reason)
        self._tally.key_rejected(key, reason)

    def __getattr__(self, name):  # key_busy and anything else: the metrics' own
        return getattr(self._metrics, name)
