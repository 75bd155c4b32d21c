"""CostModel: measured seconds per prefill token and per decode round (EMA of step timings)."""

from __future__ import annotations

import pytest

from superfluid.core.costs import CostModel
from superfluid.core.tick import StepTiming


def decode(n: int, seconds: float) -> StepTiming:
    return StepTiming(prefill_tokens=0, decode_tokens=n, seconds=seconds)


def prefill(n: int, seconds: float, decode_tokens: int = 0) -> StepTiming:
    return StepTiming(prefill_tokens=n, decode_tokens=decode_tokens, seconds=seconds)


def test_defaults_before_any_measurement():
    cm = CostModel(prefill_s_per_token=0.003, decode_s_per_round=0.04)
    assert cm.prefill_per_token() == pytest.approx(0.003)
    assert cm.decode_round(1) == pytest.approx(0.04)
    assert cm.decode_round(8) == pytest.approx(0.04)
    assert cm.samples == 0


def test_first_decode_observation_is_taken_as_is():
    cm = CostModel(alpha=0.25)
    cm.observe([decode(4, 0.1)])
    assert cm.decode_round(4) == pytest.approx(0.1)
    assert cm.samples == 1


def test_decode_only_steps_ema_toward_observed_value():
    cm = CostModel(alpha=0.25)
    cm.observe([decode(4, 0.1)])
    cm.observe([decode(4, 0.2)])
    assert cm.decode_round(4) == pytest.approx(0.125)   # 0.1 + 0.25 * (0.2 - 0.1)
    for _ in range(60):
        cm.observe([decode(4, 0.2)])
    assert cm.decode_round(4) == pytest.approx(0.2, rel=1e-6)
    # Decode-only steps leave the prefill rate alone.
    assert cm.prefill_per_token() == pytest.approx(0.002)


def test_decode_observations_are_per_batch_size():
    cm = CostModel()
    cm.observe([decode(1, 0.01), decode(8, 0.05)])
    assert cm.decode_round(1) == pytest.approx(0.01)
    assert cm.decode_round(8) == pytest.approx(0.05)
    assert cm.as_dict()["decode_s_per_round"] == {"1": pytest.approx(0.01), "8": pytest.approx(0.05)}
    assert cm.samples == 2


def test_first_prefill_measurement_replaces_the_guess():
    """MLX's CPU kernels take 0.1 s a prompt token against the 2 ms guess: from the guess, an EMA
    took six steps to come near; the first step of 16 tokens or more is taken as is."""
    cm = CostModel(prefill_s_per_token=0.002, alpha=0.25)
    cm.observe([prefill(32, 3.2)])
    assert cm.prefill_per_token() == pytest.approx(0.1)
    assert cm.prefill_measured
    cm.observe([prefill(64, 3.2)])                         # later ones move it by the EMA
    assert cm.prefill_per_token() == pytest.approx(0.1 + 0.25 * (0.05 - 0.1))
    assert cm.decode_round(1) == pytest.approx(0.02)       # untouched


def test_a_few_tokens_do_not_count_as_the_first_measurement():
    """A 3-token step is mostly fixed overhead: it moves the guess a little and the next real
    step still replaces it."""
    cm = CostModel(prefill_s_per_token=0.002, alpha=0.25)
    cm.observe([prefill(3, 0.03)])
    assert not cm.prefill_measured
    assert cm.prefill_per_token() == pytest.approx(0.002 + 0.25 * (3 / 64) * (0.01 - 0.002))
    cm.observe([prefill(100, 0.5)])
    assert cm.prefill_measured and cm.prefill_per_token() == pytest.approx(0.005)


def test_mixed_step_subtracts_the_decode_part():
    cm = CostModel(prefill_s_per_token=0.002, decode_s_per_round=0.02, alpha=0.25)
    cm.observe([prefill(100, 0.5, decode_tokens=2)])
    assert cm.prefill_per_token() == pytest.approx((0.5 - 0.02) / 100)
    # A mixed step does not move the decode table.
    assert cm.as_dict()["decode_s_per_round"] == {}


def test_prefill_converges_to_measured_rate():
    cm = CostModel(prefill_s_per_token=0.002)
    for _ in range(80):
        cm.observe([prefill(512, 512 * 0.001)])
    assert cm.prefill_per_token() == pytest.approx(0.001, rel=1e-6)


def test_small_prefill_steps_weigh_less():
    big, small = CostModel(alpha=0.25), CostModel(alpha=0.25)
    for cm in (big, small):
        cm.observe([prefill(64, 64 * 0.002)])              # measured: 2 ms a token
    big.observe([prefill(64, 64 * 0.01)])
    small.observe([prefill(8, 8 * 0.01)])
    assert big.prefill_per_token() == pytest.approx(0.002 + 0.25 * 0.008)
    assert small.prefill_per_token() == pytest.approx(0.002 + 0.25 * (8 / 64) * 0.008)


def test_interpolates_between_measured_batch_sizes():
    cm = CostModel()
    cm.observe([decode(2, 0.02), decode(6, 0.06)])
    assert cm.decode_round(3) == pytest.approx(0.03)
    assert cm.decode_round(4) == pytest.approx(0.04)
    assert cm.decode_round(5) == pytest.approx(0.05)


def test_below_smallest_measured_uses_smallest():
    cm = CostModel(decode_s_per_round=1.0)
    cm.observe([decode(4, 0.04)])
    assert cm.decode_round(1) == pytest.approx(0.04)


def test_above_largest_measured_never_cheaper():
    cm = CostModel()
    cm.observe([decode(4, 0.04)])
    assert cm.decode_round(6) == pytest.approx(0.04 * 1.1)
    costs = [cm.decode_round(n) for n in range(1, 17)]
    assert costs == sorted(costs)


def test_zero_or_negative_timings_ignored():
    cm = CostModel(prefill_s_per_token=0.002, decode_s_per_round=0.02)
    cm.observe([decode(4, 0.0), decode(4, -1.0), prefill(100, 0.0), prefill(100, -0.5)])
    assert cm.samples == 0
    assert cm.prefill_per_token() == pytest.approx(0.002)
    assert cm.decode_round(4) == pytest.approx(0.02)


def test_never_below_zero():
    cm = CostModel(prefill_s_per_token=0.002, decode_s_per_round=0.02)
    cm.observe([decode(8, 1.0)])                      # decode part is expensive ...
    cm.observe([prefill(100, 0.01, decode_tokens=8)])  # ... more than the whole mixed step
    assert cm.prefill_per_token() > 0
    assert cm.decode_round(0) == 0.0
    assert cm.decode_round(-3) == 0.0
    for n in range(1, 20):
        assert cm.decode_round(n) >= 0
    for _ in range(200):
        cm.observe([prefill(4096, 1e-6)])
    assert cm.prefill_per_token() >= 0


def test_step_with_no_tokens_counts_but_changes_nothing():
    cm = CostModel()
    before = cm.as_dict()
    cm.observe([StepTiming(0, 0, 0.5)])
    assert cm.as_dict() == before
