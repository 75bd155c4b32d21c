"""Prometheus metrics, fed by the scheduler's observer hooks and served on /metrics."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from superfluid.core import qos as qos_classes

TTFT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 8.0, 13.0, 21.0, 34.0, 60.0)


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.ttft = Histogram("superfluid_ttft_seconds", "Time to first token, from admission",
                              ["model", "qos"], buckets=TTFT_BUCKETS, registry=r)
        self.prefill_budget = Gauge("superfluid_prefill_budget_tokens",
                                    "Prefill budget of the last tick (tokens across lanes)", ["model"], registry=r)
        self.decode_grant = Gauge("superfluid_decode_grant_tokens",
                                  "Decode rounds granted per decoding lane in the last tick", ["model"], registry=r)
        self.lanes_busy = Gauge("superfluid_lanes_busy", "Lanes holding a generation", ["model"], registry=r)
        self.lanes_max = Gauge("superfluid_lanes_max", "Lanes configured (--max-batch)", ["model"], registry=r)
        self.lanes_by_class = Gauge("superfluid_lanes_by_class", "Busy lanes per QoS class",
                                    ["model", "qos"], registry=r)
        self.queue_depth = Gauge("superfluid_queue_depth", "Requests waiting for a lane, per QoS class",
                                 ["model", "qos"], registry=r)
        self.prompt_tokens = Counter("superfluid_prompt_tokens", "Prompt tokens of finished requests",
                                     ["model"], registry=r)
        self.generated_tokens = Counter("superfluid_generated_tokens", "Tokens generated",
                                        ["model"], registry=r)
        self.prefill_tokens = Counter("superfluid_prefill_tokens",
                                      "Prompt tokens the engine actually prefilled", ["model"], registry=r)
        self.requests = Counter("superfluid_requests", "Finished generations by finish reason",
                                ["model", "finish_reason"], registry=r)
        self.ticks = Counter("superfluid_ticks", "Engine ticks run", ["model"], registry=r)
        self.tick_seconds = Histogram("superfluid_tick_seconds", "Engine tick duration", ["model"],
                                      buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8), registry=r)
        self.preemptions = Counter("superfluid_preemptions", "Lanes preempted for a more urgent class",
                                   ["model"], registry=r)
        self.promotions = Counter("superfluid_starvation_promotions",
                                  "Lanes admitted after waiting the starvation bound", ["model"], registry=r)
        self.parked_bytes = Gauge("superfluid_parked_kv_bytes", "KV parked in host memory by preempted lanes",
                                  ["model"], registry=r)
        self.cache_hits = Counter("superfluid_prefix_cache_hits", "Lanes seeded from a cached prefix",
                                  ["model"], registry=r)
        self.cache_hit_tokens = Counter("superfluid_prefix_cache_hit_tokens",
                                        "Prompt tokens taken from cached prefixes instead of prefilled",
                                        ["model"], registry=r)
        self.cached_tokens = Gauge("superfluid_prefix_cache_tokens", "Tokens held as cached prefixes in free slots",
                                   ["model"], registry=r)
        self.evictions = Counter("superfluid_prefix_evictions", "Cached prefixes evicted from the KV pool",
                                 ["model", "reason"], registry=r)
        self.pool_rejections = Counter("superfluid_kv_pool_rejections",
                                       "Plans the shared KV pool could not hold (room freed, planned again)",
                                       ["model"], registry=r)
        self.host_bytes = Gauge("superfluid_host_cache_bytes", "Prefixes held in host memory (bytes)",
                                ["model"], registry=r)
        self.host_entries = Gauge("superfluid_host_cache_entries", "Prefixes held in host memory",
                                  ["model"], registry=r)
        self.pressure = Gauge("superfluid_memory_pressure_level", "Memory pressure: 0 ok, 1 warning, 2 critical",
                              ["model"], registry=r)
        self.kv_used = Gauge("superfluid_kv_cells_used", "KV cells in use", ["model"], registry=r)
        self.kv_capacity = Gauge("superfluid_kv_cells_capacity", "KV cells in the pool", ["model"], registry=r)
        self.kv_occupancy = Gauge("superfluid_kv_pool_occupancy", "KV pool occupancy (0..1)", ["model"], registry=r)

    def tick_done(self, model: str, stats) -> None:
        self.ticks.labels(model).inc()
        self.tick_seconds.labels(model).observe(stats.seconds)
        if stats.prefill_budget:
            self.prefill_budget.labels(model).set(stats.prefill_budget)
        if stats.decode_grant:
            self.decode_grant.labels(model).set(stats.decode_grant)
        self.lanes_busy.labels(model).set(stats.lanes_busy)
        self.lanes_max.labels(model).set(stats.max_lanes)
        for cls in qos_classes.CLASSES:
            self.queue_depth.labels(model, cls).set(stats.queue_by_class.get(cls, 0))
            self.lanes_by_class.labels(model, cls).set(stats.lanes_by_class.get(cls, 0))
        if stats.prefill_tokens:
            self.prefill_tokens.labels(model).inc(stats.prefill_tokens)
        for cls, seconds in stats.first_tokens:
            self.ttft.labels(model, cls).observe(seconds)
        if stats.preempted:
            self.preemptions.labels(model).inc(stats.preempted)
        if stats.promoted:
            self.promotions.labels(model).inc(stats.promoted)
        self.parked_bytes.labels(model).set(stats.parked_bytes)
        if stats.cache_hits:
            self.cache_hits.labels(model).inc(stats.cache_hits)
            self.cache_hit_tokens.labels(model).inc(stats.cache_hit_tokens)
        self.cached_tokens.labels(model).set(stats.cached_tokens)
        for reason, count in stats.evictions.items():
            self.evictions.labels(model, reason).inc(count)
        if stats.pool_rejections:
            self.pool_rejections.labels(model).inc(stats.pool_rejections)
        self.host_bytes.labels(model).set(stats.host_bytes)
        self.host_entries.labels(model).set(stats.host_entries)
        self.pressure.labels(model).set({"warning": 1, "critical": 2}.get(stats.pressure, 0))
        self.kv_used.labels(model).set(stats.kv_used)
        self.kv_capacity.labels(model).set(stats.kv_capacity)
        if stats.kv_capacity:
            self.kv_occupancy.labels(model).set(stats.kv_used / stats.kv_capacity)

    def lane_finished(self, model: str, lane) -> None:
        self.prompt_tokens.labels(model).inc(lane.n_prompt)
        self.generated_tokens.labels(model).inc(lane.n_output)
        self.requests.labels(model, lane.finish_reason or "error").inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


METRICS = Metrics()
