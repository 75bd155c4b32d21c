"""tools/bench/agents_chat's one-at-a-time reference: what the agents' first tokens are measured
against. Arithmetic on recorded results, no server."""

from __future__ import annotations

import pytest

from tools.bench.agents_chat import agent_summary, one_at_a_time


def burst(*ttfts, tokens=1000):
    return [{"ttft": t, "prompt_tokens": tokens} for t in ttfts]


def test_one_after_another_shortest_first_at_the_lone_rate():
    assert one_at_a_time([300, 100, 200], 100, 2.0) == pytest.approx([2.0, 6.0, 12.0])


def test_the_reference_averages_the_lone_agents_either_side_of_the_burst():
    """A machine that slowed down during the burst: 10 s before, 14 s after, so 12 s a prompt."""
    s = agent_summary(burst(12, 24, 36, 48), {"ttft": 10.0, "prompt_tokens": 1000},
                      {"ttft": 14.0, "prompt_tokens": 1000})
    assert s["reference_mean_s"] == pytest.approx(30.0)          # 12 × (1+2+3+4)/4
    assert s["mean_over_reference"] == pytest.approx(1.0)
    assert s["mean_over_reference_before"] == pytest.approx(1.2)  # against the 10 s alone
    assert s["p90_over_reference"] == pytest.approx(1.0)
    assert s["lone_after_ttft_s"] == 14.0


def test_without_the_lone_agent_after_the_one_before_is_the_reference():
    s = agent_summary(burst(10, 20), {"ttft": 10.0, "prompt_tokens": 1000}, {"ttft": None, "prompt_tokens": None})
    assert s["mean_over_reference"] == s["mean_over_reference_before"] == pytest.approx(1.0)
    assert "lone_after_ttft_s" not in s


def test_no_reference_without_a_lone_agent_or_a_prompt_count():
    assert "mean_over_reference" not in agent_summary(burst(10, 20), None)
    assert "mean_over_reference" not in agent_summary([{"ttft": 5.0, "prompt_tokens": None}],
                                                      {"ttft": 10.0, "prompt_tokens": 1000})
