"""Prometheus metrics, fed by the scheduler's observer hooks and served on /metrics."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from superfluid.core import qos as qos_classes

from .kv_pool_metrics import KVPoolGauges
from .model_server_metrics import ModelServerGauges

TTFT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 8.0, 13.0, 21.0, 34.0, 60.0)
# what authentication and the key limits add to a request: tens of microseconds (10 µs … 10 ms), 1 ms the bound
AUTH_BUCKETS = (0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01)
# a session's seal (--park): its finished turn's KV written to the state dir, queueing to the engine's answer
SEAL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
# a whole request, from its handler's start to its response's end (a stream: to its last event)
REQUEST_BUCKETS = (0.001, 0.005, 0.025, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)


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
        self.quiet_ticks = Counter("superfluid_quiet_ticks", "Ticks run past the free-lane target because "
                                   "no client reads their tokens before they end", ["model"], registry=r)
        self.ticks_ended_early = Counter("superfluid_ticks_ended_early", "Ticks ended before their plan was "
                                         "done (a stop or yield request, a full KV pool, a quiet tick's "
                                         "finished lane)", ["model"], registry=r)
        self.tick_seconds = Histogram("superfluid_tick_seconds", "Engine tick duration", ["model"],
                                      buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8), registry=r)
        self.seal_seconds = Histogram("superfluid_seal_seconds", "A session's seal with --park: from queueing "
                                      "the save of its finished turn's KV to the engine's answer (the next tick "
                                      "copies it and writes the park artifact)", ["model"], buckets=SEAL_BUCKETS,
                                      registry=r)
        self.preemptions = Counter("superfluid_preemptions", "Lanes preempted for a more urgent class",
                                   ["model"], registry=r)
        self.images_encoded = Counter("superfluid_images_encoded", "Images the vision encoder ran on (an image "
                                      "already encoded, or whose KV a prefix holds, is not counted again)",
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
        self.cache_host_hits = Counter("superfluid_prefix_cache_host_hits", "Lanes seeded from a prefix held "
                                       "in host memory (of superfluid_prefix_cache_hits; the rest came from the pool)",
                                       ["model"], registry=r)
        self.cached_tokens = Gauge("superfluid_prefix_cache_tokens", "Tokens held as cached prefixes in free slots",
                                   ["model"], registry=r)
        self.evictions = Counter("superfluid_prefix_evictions", "Cached prefixes evicted from the KV pool",
                                 ["model", "reason"], registry=r)
        self.pool_rejections = Counter("superfluid_kv_pool_rejections",
                                       "Plans the shared KV pool could not hold (room freed, planned again)",
                                       ["model"], registry=r)
        # speculative decoding (basert --speculate): drafts verified, and how many the model kept
        self.spec_drafted = Counter("superfluid_spec_drafted_tokens", "Tokens drafted by prompt lookup and "
                                    "verified in a forward pass", ["model"], registry=r)
        self.spec_accepted = Counter("superfluid_spec_accepted_tokens", "Drafted tokens the model accepted",
                                     ["model"], registry=r)
        self.spec_steps = Counter("superfluid_spec_verify_steps", "Engine steps that verified drafts",
                                  ["model"], registry=r)
        self.spec_rate = Gauge("superfluid_spec_acceptance_rate", "Accepted / drafted tokens since start",
                               ["model"], registry=r)
        self.spec_per_step = Gauge("superfluid_spec_accepted_tokens_per_step", "Accepted drafted tokens per "
                                   "verifying step since start", ["model"], registry=r)
        self._spec_totals: dict[str, list[int]] = {}  # model -> [drafted, accepted, steps]
        self.host_bytes = Gauge("superfluid_host_cache_bytes", "Prefixes held in host memory (bytes)",
                                ["model"], registry=r)
        self.host_entries = Gauge("superfluid_host_cache_entries", "Prefixes held in host memory",
                                  ["model"], registry=r)
        self.pressure = Gauge("superfluid_memory_pressure_level", "Memory pressure: 0 ok, 1 warning, 2 critical",
                              ["model"], registry=r)
        self.kv_used = Gauge("superfluid_kv_cells_used", "KV cells in use", ["model"], registry=r)
        self.kv_capacity = Gauge("superfluid_kv_cells_capacity", "KV cells in the pool", ["model"], registry=r)
        self.kv_occupancy = Gauge("superfluid_kv_pool_occupancy", "KV pool occupancy (0..1)", ["model"], registry=r)
        # per API key (the key's name from the policy, never its secret; "-" without a policy)
        self.key_requests = Counter("superfluid_key_requests", "Generations admitted past the key's limits",
                                    ["key"], registry=r)
        self.key_tokens = Counter("superfluid_key_tokens", "Tokens charged to a key (prompt, completion)",
                                  ["key", "kind"], registry=r)
        self.key_rejections = Counter("superfluid_key_rejections", "Generations refused by a key's limits "
                                      "(requests_per_minute, tokens_per_minute, lanes)", ["key", "reason"], registry=r)
        self.key_in_flight = Gauge("superfluid_key_in_flight", "Generations in flight (queued or running) "
                                   "per key with limits", ["key"], registry=r)
        # per request: the key's identification and grants, its class ceiling, and the key limiter's
        # admit, release and x-ratelimit-* headers, summed (see keys/auth.py); the handler's own work not
        self.auth_seconds = Histogram("superfluid_http_auth_seconds", "Time a request spends in "
                                      "authentication and its key's limits (identify, class ceiling, "
                                      "limiter admit + release + headers), summed per request",
                                      buckets=AUTH_BUCKETS, registry=r)
        # per route (its pattern, e.g. /v1/sessions/{sid}/turns, so ids do not make new series)
        self.http_requests = Counter("superfluid_http_requests", "HTTP requests answered, by route "
                                     "pattern, method and status (499: the client left)",
                                     ["route", "method", "status"], registry=r)
        self.http_seconds = Histogram("superfluid_http_request_seconds", "HTTP request duration by route "
                                      "pattern, to the response's end", ["route"], buckets=REQUEST_BUCKETS,
                                      registry=r)
        # the model-server protocol's gauges (queued, running, KV use, cache layout), read at scrape
        # time for Kubernetes' inference gateway: model_server_metrics.py
        self.model_server = ModelServerGauges()
        r.register(self.model_server)
        # the KV pool's size and layout, from each engine's report at scrape time: kv_pool_metrics.py
        self.kv_pool = KVPoolGauges()
        r.register(self.kv_pool)
        self._children: dict[tuple, object] = {}
        self._values: dict[tuple, float] = {}  # the value each gauge series was last set to

    def _child(self, metric, *labels):
        """``metric.labels(*labels)``, remembered: the model's thread updates some thirty
        series after every tick, and ``labels()`` validates and locks on every call."""
        key = (metric, labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    def _set(self, gauge, labels: tuple, value) -> None:
        """Set a gauge series only when its value changed: most keep their value tick after tick."""
        key = (gauge, labels)
        if self._values.get(key) != value:
            self._values[key] = value
            self._child(gauge, *labels).set(value)

    def _speculated(self, model: str, stats) -> None:
        totals = self._spec_totals.setdefault(model, [0, 0, 0])
        totals[0] += stats.drafted_tokens
        totals[1] += stats.accepted_tokens
        totals[2] += stats.verify_steps
        self._child(self.spec_drafted, model).inc(stats.drafted_tokens)
        self._child(self.spec_accepted, model).inc(stats.accepted_tokens)
        self._child(self.spec_steps, model).inc(stats.verify_steps)
        self._set(self.spec_rate, (model,), totals[1] / totals[0])
        if totals[2]:
            self._set(self.spec_per_step, (model,), totals[1] / totals[2])

    def serve_models(self, models, cell_block: int | None = None) -> None:
        """Report the model-server gauges for the models ``models()`` returns (the daemon's)."""
        self.model_server.serve(models, cell_block)
        self.kv_pool.serve(models)

    def tick_done(self, model: str, stats) -> None:
        self.model_server.tick_done(model, stats)
        self._child(self.ticks, model).inc()
        self._child(self.tick_seconds, model).observe(stats.seconds)
        if stats.quiet:
            self._child(self.quiet_ticks, model).inc()
        if stats.stopped_early:
            self._child(self.ticks_ended_early, model).inc()
        if stats.prefill_budget:
            self._set(self.prefill_budget, (model,), stats.prefill_budget)
        if stats.decode_grant:
            self._set(self.decode_grant, (model,), stats.decode_grant)
        self._set(self.lanes_busy, (model,), stats.lanes_busy)
        self._set(self.lanes_max, (model,), stats.max_lanes)
        for cls in qos_classes.CLASSES:
            self._set(self.queue_depth, (model, cls), stats.queue_by_class.get(cls, 0))
            self._set(self.lanes_by_class, (model, cls), stats.lanes_by_class.get(cls, 0))
        if stats.prefill_tokens:
            self._child(self.prefill_tokens, model).inc(stats.prefill_tokens)
        for cls, seconds in stats.first_tokens:
            self._child(self.ttft, model, cls).observe(seconds)
        if stats.preempted:
            self._child(self.preemptions, model).inc(stats.preempted)
        if stats.images_encoded:
            self._child(self.images_encoded, model).inc(stats.images_encoded)
        if stats.promoted:
            self._child(self.promotions, model).inc(stats.promoted)
        self._set(self.parked_bytes, (model,), stats.parked_bytes)
        if stats.cache_hits:
            self._child(self.cache_hits, model).inc(stats.cache_hits)
            self._child(self.cache_hit_tokens, model).inc(stats.cache_hit_tokens)
            if stats.cache_host_hits:
                self._child(self.cache_host_hits, model).inc(stats.cache_host_hits)
        self._set(self.cached_tokens, (model,), stats.cached_tokens)
        for reason, count in stats.evictions.items():
            self._child(self.evictions, model, reason).inc(count)
        if stats.pool_rejections:
            self._child(self.pool_rejections, model).inc(stats.pool_rejections)
        if stats.drafted_tokens:
            self._speculated(model, stats)
        self._set(self.host_bytes, (model,), stats.host_bytes)
        self._set(self.host_entries, (model,), stats.host_entries)
        self._set(self.pressure, (model,), {"warning": 1, "critical": 2}.get(stats.pressure, 0))
        self._set(self.kv_used, (model,), stats.kv_used)
        self._set(self.kv_capacity, (model,), stats.kv_capacity)
        if stats.kv_capacity:
            self._set(self.kv_occupancy, (model,), stats.kv_used / stats.kv_capacity)

    def lane_finished(self, model: str, lane) -> None:
        self._child(self.prompt_tokens, model).inc(lane.n_prompt)
        self._child(self.generated_tokens, model).inc(lane.n_output)
        self._child(self.requests, model, lane.finish_reason or "error").inc()

    def key_admitted(self, key: str) -> None:
        self._child(self.key_requests, key).inc()

    def key_finished(self, key: str, prompt_tokens: int, completion_tokens: int) -> None:
        if prompt_tokens:
            self._child(self.key_tokens, key, "prompt").inc(prompt_tokens)
        if completion_tokens:
            self._child(self.key_tokens, key, "completion").inc(completion_tokens)

    def key_busy(self, key: str, in_flight: int) -> None:
        self._child(self.key_in_flight, key).set(in_flight)

    def key_rejected(self, key: str, reason: str) -> None:
        self._child(self.key_rejections, key, reason).inc()

    def auth_timed(self, seconds: float) -> None:
        self.auth_seconds.observe(seconds)

    def http_answered(self, route: str, method: str, status: int, seconds: float) -> None:
        self._child(self.http_requests, route, method, str(status)).inc()
        self._child(self.http_seconds, route).observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)


METRICS = Metrics()
