"""Reading pressure sources: the worst level any of them reports, at most every half second."""

from __future__ import annotations

import logging
from typing import Protocol

log = logging.getLogger("superfluid.pressure")

PRESSURE_CHECK_S = 0.5
LEVELS = ("ok", "warning", "critical")


class PressureSource(Protocol):
    """What a pressure source plugin registers: ``level()`` is called on the model's thread
    between ticks, every PRESSURE_CHECK_S at most; it must be cheap and must not block."""

    def level(self) -> str:
        """"ok", "warning" or "critical"."""


class PressureGauge:
    def __init__(self, name: str, sources: list[PressureSource]):
        self.name = name
        self.sources = list(sources)
        self.level = "ok"
        self._checked = 0.0

    def poll(self, now: float) -> bool:
        """Read the sources if it is time; True if they were read (``level`` is then fresh)."""
        if not self.sources or now - self._checked < PRESSURE_CHECK_S:
            return False
        self._checked = now
        worst = 0
        for source in self.sources:
            try:
                level = source.level()
            except Exception:  # a broken source must not stop the model
                log.exception("model %s: pressure source %r failed", self.name, source)
                continue
            if level in LEVELS:
                worst = max(worst, LEVELS.index(level))
        self.level = LEVELS[worst]
        return True
