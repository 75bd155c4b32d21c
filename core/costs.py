"""The measured cost model: seconds per prefill token and per decode round, per model.

Planners size ticks from these numbers instead of constants, so the same policy fits a 135M model
on two CPU cores and a 4B model on a GPU. Every tick's step timings update them (an EMA).

The first real measurement of each replaces the starting guess instead of moving it a quarter of
the way: the guess (2 ms a prompt token) is 50 times too fast for MLX's CPU kernels, and an EMA
from it took six 12-second steps to get near the real rate, while a dropped request or a chat
waited behind each of them."""

from __future__ import annotations

from .tick import StepTiming

CALIBRATION_TOKENS = 16  # a prefill step this long or longer measures the rate, not the overhead


class CostModel:
    def __init__(self, prefill_s_per_token: float = 0.002, decode_s_per_round: float = 0.02,
                 alpha: float = 0.25):
        self.alpha = alpha
        self._prefill = prefill_s_per_token
        self._decode: dict[int, float] = {}
        self._decode_default = decode_s_per_round
        self.samples = 0
        self.prefill_measured = False  # a step of CALIBRATION_TOKENS or more has set the rate

    def prefill_per_token(self) -> float:
        return self._prefill

    def decode_round(self, n_lanes: int) -> float:
        """Seconds for one decode round of ``n_lanes`` lanes (nearest measured batch size if this
        one has not been seen; a round never gets cheaper with more lanes)."""
        if n_lanes <= 0:
            return 0.0
        if n_lanes in self._decode:
            return self._decode[n_lanes]
        if not self._decode:
            return self._decode_default
        below = [n for n in self._decode if n < n_lanes]
        above = [n for n in self._decode if n > n_lanes]
        if below and above:
            lo, hi = max(below), min(above)
            f = (n_lanes - lo) / (hi - lo)
            return self._decode[lo] + f * (self._decode[hi] - self._decode[lo])
        if below:
            lo = max(below)
            return self._decode[lo] * (1 + 0.05 * (n_lanes - lo))
        return self._decode[min(above)]

    def observe(self, steps: list[StepTiming]) -> None:
        for step in steps:
            if step.seconds <= 0:
                continue
            if step.prefill_tokens == 0 and step.decode_tokens > 0:
                self._ema_decode(step.decode_tokens, step.seconds)
            elif step.prefill_tokens > 0:
                decode_part = self.decode_round(step.decode_tokens) if step.decode_tokens else 0.0
                per_token = max(step.seconds - decode_part, step.seconds * 0.5) / step.prefill_tokens
                if not self.prefill_measured and step.prefill_tokens >= CALIBRATION_TOKENS:
                    self._prefill = per_token  # the first measurement replaces the guess
                    self.prefill_measured = True
                else:
                    # Tiny steps are dominated by fixed overhead; weigh them less.
                    weight = self.alpha * min(1.0, step.prefill_tokens / 64)
                    self._prefill += weight * (per_token - self._prefill)
            self.samples += 1

    def _ema_decode(self, n: int, seconds: float) -> None:
        old = self._decode.get(n)
        self._decode[n] = seconds if old is None else old + self.alpha * (seconds - old)

    def as_dict(self) -> dict:
        return {"prefill_s_per_token": self._prefill,
                "decode_s_per_round": {str(k): v for k, v in sorted(self._decode.items())}}
