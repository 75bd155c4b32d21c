"""The KV pool's size and layout on /metrics, read from each model's engine at scrape time.

An engine adapter that sizes a pool (llama.cpp, MLX) reports it when its worker is ready:
``kv_bytes`` (the KV bytes allocated: llama.cpp's, checked against its own log; MLX's budget, which
its caches grow into) and ``kv_pool`` (sequences, cells, bytes per cell, shared or per-sequence,
which limit set the cells, the free memory the 60 % cap was taken of). They change only when a
worker restarts, so they are read from ``engine.describe()`` when /metrics is asked rather than
pushed after every tick. A model whose engine reports no pool (basert's pages have their own
accounting) has no series.

====================================  =============================================================
``superfluid_kv_pool_bytes``           KV bytes allocated for the pool
``superfluid_kv_pool_bytes_per_cell``  one cell's K + V bytes over every layer
``superfluid_kv_pool_sequences``       sequences (slots) the engine holds, lanes and spare
``superfluid_kv_pool_budget_bytes``    the shared pool's cap: 60 % of the memory the weights leave free
``superfluid_kv_pool_info``            1, labelled ``layout`` (shared / per-sequence), ``cap`` (the
                                       limit that set the cells) and ``memory`` (where it was measured)
====================================  =============================================================
"""

from __future__ import annotations

from typing import Callable

from prometheus_client.core import GaugeMetricFamily

POOL_BYTES = "superfluid_kv_pool_bytes"


def pool_of(runtime) -> tuple[int, dict] | None:
    """(KV bytes, layout) a model's engine reports, None where it reports none."""
    try:
        described = runtime.engine.describe()
    except Exception:  # noqa: BLE001  a scrape must not fail for one engine's report
        return None
    kv_bytes = described.get("kv_bytes")
    if not kv_bytes:
        return None
    return int(kv_bytes), described.get("kv_pool") or {}


class KVPoolGauges:
    """A prometheus_client custom collector over the daemon's models (see the module docstring)."""

    def __init__(self) -> None:
        self._models: Callable[[], dict] | None = None

    def serve(self, models: Callable[[], dict]) -> None:
        self._models = models

    def _families(self) -> tuple[GaugeMetricFamily, ...]:
        label = ["model"]
        return (GaugeMetricFamily(POOL_BYTES, "KV bytes allocated for the model's pool", labels=label),
                GaugeMetricFamily("superfluid_kv_pool_bytes_per_cell", "K + V bytes of one KV cell, every layer",
                                  labels=label),
                GaugeMetricFamily("superfluid_kv_pool_sequences", "KV sequences (slots) held: lanes and spare",
                                  labels=label),
                GaugeMetricFamily("superfluid_kv_pool_budget_bytes", "A shared pool's cap: 60 % of the memory "
                                  "the weights leave free where they sit", labels=label),
                GaugeMetricFamily("superfluid_kv_pool_info", "KV pool layout: shared or per-sequence, the limit "
                                  "that set its cells, where free memory was measured",
                                  labels=[*label, "layout", "cap", "memory"]))

    def describe(self):
        return self._families()

    def collect(self):
        pool_bytes, per_cell, sequences, budget, info = families = self._families()
        for name, runtime in list((self._models() if self._models else {}).items()):
            found = pool_of(runtime)
            if found is None:
                continue
            kv_bytes, layout = found
            pool_bytes.add_metric([name], kv_bytes)
            if layout:
                per_cell.add_metric([name], layout.get("bytes_per_cell", 0))
                sequences.add_metric([name], layout.get("sequences", 0))
                budget.add_metric([name], layout.get("budget_bytes", 0))
                info.add_metric([name, "shared" if layout.get("shared") else "per-sequence",
                                 str(layout.get("cap", "")), str(layout.get("memory", ""))], 1)
        return families
