"""A model's scheduling settings: its configured knobs, typed, plus what its engine declared."""

from __future__ import annotations

import attrs


@attrs.define
class SchedulerSettings:
    """Everything the core reads about one model's scheduling, as typed fields.

    ``extra`` holds the options plugins declared for themselves (``--class-lanes`` for the qos
    plugin, a third party's own keys); the core never reads it."""

    max_batch: int = 8
    context_length: int = 4096
    prefill_budget: int = 4096
    tick_decode_budget: int = 0
    tick_target_ms: int = 2000
    starvation_ticks: int = 8
    max_queue: int = 256             # queued requests per QoS class; submit refuses one more (429)
    park: bool = False               # park a preempted lane's KV in host memory
    pressure_high: float = 0.85      # KV occupancy at which cached prefixes are evicted ...
    pressure_low: float = 0.70       # ... down to this
    host_cache_bytes: int = 0        # host memory for evicted prefixes
    pinned_tokens: list[list[int]] = attrs.field(factory=list)  # --pin-prompt, tokenized
    extra: dict = attrs.field(factory=dict)
