"""The model-server protocol's gauges, so Kubernetes' inference gateway can route superfluid nodes.

The Gateway API Inference Extension's endpoint picker (EPP, now developed in llm-d-router) scrapes
each pod's /metrics for three gauges and an optional info series, under whatever names an
``engineConfigs`` entry of its ``core-metrics-extractor`` gives (chosen per pod by the label
``llm-d.ai/engine-type``). The names are free, the meaning is fixed (proposal 003):

==============================================  ==========================================================
``superfluid_num_requests_waiting``             requests waiting for a lane, every QoS class, preempted
                                                (requeued) lanes included: vLLM's ``num_requests_waiting``
``superfluid_num_requests_running``             lanes holding a generation (prefilling or decoding)
``superfluid_kv_cache_usage_perc``              KV held by running lanes / the pool's cells, 0..1 (a
                                                fraction, as vLLM's ``kv_cache_usage_perc`` is despite
                                                its name)
``superfluid_cache_config_info``                1, labelled ``block_size`` and ``num_gpu_blocks``
==============================================  ==========================================================

Each series is labelled ``model_name`` (vLLM's label). The EPP reads the first series that matches
its spec, so a node that serves several models needs ``{model_name="..."}`` in the spec.

**Read at scrape time.** The tick hook sets the other gauges after each tick, which leaves them
stale exactly when the EPP must know: a burst of requests has arrived and no tick has ended yet,
or the node went idle. This collector reads the queue and the lanes of each model's scheduler
when /metrics is asked (two ``len()`` calls, no lock taken, so a scrape never waits for a tick
nor holds one up). The pool numbers change only when a tick ends, so they come from the last
tick's stats, which the scheduler takes at one consistent point (a tick streams its tokens just
before its stats reach the collector, so a scrape may see the pool one tick behind a token).

**KV use leaves out the prefix cache.** The pool also holds cached prefixes in free slots; they are
evicted the moment a lane needs the room, so they are free capacity, as cached-but-unreferenced
blocks are in vLLM. Counting them would show a warm idle node as full and steer work (and the EPP's
saturation detector) away from the node that holds the prefixes. ``superfluid_kv_pool_occupancy``
keeps the raw occupancy, cache included.

**Blocks.** An engine with pages (basert) reports its page size. llama.cpp and MLX keep per-sequence
cells with no pages; they are reported in blocks of ``--kv-events-block-size`` tokens (the unit KV
events publish the prefix cache in), or of :data:`CELL_BLOCK_TOKENS` (16, vLLM's default block and
the unit llm-d's precise scorer hashes in) without it: ``num_gpu_blocks`` = cells // block size,
so block_size × num_gpu_blocks is the pool's size in tokens either way. Before a model's first tick
its pool size is not known yet: ``num_gpu_blocks`` is 0 (the EPP then uses its configured
capacity, as for a server without the series)."""

from __future__ import annotations

from typing import Callable

from prometheus_client.core import GaugeMetricFamily

CELL_BLOCK_TOKENS = 16
"""The block size reported for an engine whose KV has no pages (llama.cpp, MLX)."""

WAITING = "superfluid_num_requests_waiting"
RUNNING = "superfluid_num_requests_running"
KV_USAGE = "superfluid_kv_cache_usage_perc"
CACHE_INFO = "superfluid_cache_config_info"


class ModelServerGauges:
    """A prometheus_client custom collector over the daemon's models (see the module docstring)."""

    def __init__(self) -> None:
        self._models: Callable[[], dict] | None = None  # name -> ModelRuntime, the daemon's
        self._cell_block = CELL_BLOCK_TOKENS
        self._pool: dict[str, tuple[int, int, int]] = {}  # model -> (cells used, cached, capacity)
        self._block_size: dict[str, int] = {}

    def serve(self, models: Callable[[], dict], cell_block: int | None = None) -> None:
        """Report the models ``models()`` returns (the daemon's ``models`` dict) from now on;
        ``cell_block``: the block size for engines without pages (``--kv-events-block-size``)."""
        self._models = models
        self._cell_block = int(cell_block or CELL_BLOCK_TOKENS)
        self._block_size.clear()

    def tick_done(self, model: str, stats) -> None:
        # one tuple, replaced whole: a scrape on another thread reads either tick's numbers
        self._pool[model] = (stats.kv_used, stats.cached_tokens, stats.kv_capacity)

    def usage(self, model: str) -> float:
        """KV held by running lanes over the pool's cells, 0..1 (0 before the first tick)."""
        used, cached, capacity = self._pool.get(model, (0, 0, 0))
        if not capacity:
            return 0.0
        # llama.cpp's shared pool counts a cell two sequences share twice: an upper bound, capped
        return min(1.0, max(0, used - cached) / capacity)

    def blocks(self, model: str, runtime) -> tuple[int, int]:
        """(block size in tokens, blocks the pool holds) for ``model``: the engine's page size, or
        for cells without pages the one :meth:`serve` was given. Asked once per model."""
        size = self._block_size.get(model)
        if size is None:
            size = int(runtime.engine.describe().get("block_size") or self._cell_block)
            self._block_size[model] = size
        return size, self._pool.get(model, (0, 0, 0))[2] // size

    def _families(self) -> tuple[GaugeMetricFamily, ...]:
        label = ["model_name"]
        return (GaugeMetricFamily(WAITING, "Requests waiting for a lane, all QoS classes (read at scrape time)",
                                  labels=label),
                GaugeMetricFamily(RUNNING, "Requests holding a lane, prefilling or decoding (read at scrape time)",
                                  labels=label),
                GaugeMetricFamily(KV_USAGE, "KV cache held by running requests, 0..1 of the pool (cached "
                                  "prefixes, evictable at once, count as free)", labels=label),
                GaugeMetricFamily(CACHE_INFO, "KV cache layout: block_size (tokens) and num_gpu_blocks",
                                  labels=[*label, "block_size", "num_gpu_blocks"]))

    def describe(self):
        return self._families()

    def collect(self):
        waiting, running, usage, info = families = self._families()
        for name, runtime in list((self._models() if self._models else {}).items()):
            loop = runtime.loop
            waiting.add_metric([name], len(loop.queue))
            running.add_metric([name], len(loop.lanes))
            usage.add_metric([name], self.usage(name))
            size, count = self.blocks(name, runtime)
            info.add_metric([name, str(size), str(count)], 1)
        return families
