"""The Prometheus series the scheduler's tick hook feeds: gauges set only when they change must
still show every change (a fresh registry, no server)."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from superfluid.core.stats import TickStats
from superfluid.plugins.http.info.metrics import Metrics


def stats(**changes) -> TickStats:
    values = dict(model="m", seconds=0.05, prefill_tokens=0, decode_tokens=4, prefill_budget=4096,
                  decode_grant=6, lanes_busy=2, max_lanes=8, queue_depth=0, stopped_early=False,
                  kv_used=100, kv_capacity=1000, first_tokens=[], finished=[],
                  queue_by_class={}, lanes_by_class={"agent": 2})
    values.update(changes)
    return TickStats(**values)


def samples(metrics: Metrics) -> dict[tuple, float]:
    text = metrics.render().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_gauges_follow_each_tick_and_counters_add_up():
    metrics = Metrics()
    metrics.tick_done("m", stats())
    metrics.tick_done("m", stats())                                    # same values again
    metrics.tick_done("m", stats(lanes_busy=0, lanes_by_class={}, queue_by_class={"interactive": 3},
                                 kv_used=0, prefill_tokens=7))
    got = samples(metrics)
    assert got[("superfluid_lanes_busy", (("model", "m"),))] == 0
    assert got[("superfluid_lanes_by_class", (("model", "m"), ("qos", "agent")))] == 0
    assert got[("superfluid_queue_depth", (("model", "m"), ("qos", "interactive")))] == 3
    assert got[("superfluid_queue_depth", (("model", "m"), ("qos", "background")))] == 0
    assert got[("superfluid_kv_pool_occupancy", (("model", "m"),))] == 0
    assert got[("superfluid_ticks_total", (("model", "m"),))] == 3
    assert got[("superfluid_prefill_tokens_total", (("model", "m"),))] == 7
    metrics.tick_done("m", stats(lanes_busy=5))
    assert samples(metrics)[("superfluid_lanes_busy", (("model", "m"),))] == 5


def test_each_model_has_its_own_series():
    metrics = Metrics()
    metrics.tick_done("a", stats(model="a", lanes_busy=1))
    metrics.tick_done("b", stats(model="b", lanes_busy=1))
    metrics.tick_done("a", stats(model="a", lanes_busy=4))
    got = samples(metrics)
    assert got[("superfluid_lanes_busy", (("model", "a"),))] == 4
    assert got[("superfluid_lanes_busy", (("model", "b"),))] == 1
