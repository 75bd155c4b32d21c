"""The model-server protocol's gauges read at scrape time (fake runtimes, a fresh registry, no
server): queue and lanes as they are now, not as the last tick left them; KV use without the
evictable prefix cache; the cache layout. tests/server/test_model_server_protocol.py runs them
against a real server."""

from __future__ import annotations

from types import SimpleNamespace

from prometheus_client.parser import text_string_to_metric_families

from superfluid.core.stats import TickStats
from superfluid.plugins.http.info.metrics import Metrics
from superfluid.plugins.http.info.model_server_metrics import (CACHE_INFO, CELL_BLOCK_TOKENS, KV_USAGE, RUNNING,
                                                          WAITING)


def runtime(queued: int = 0, running: int = 0, describe: dict | None = None):
    """What the collector reads of a daemon's ModelRuntime: its loop's queue and lanes, its engine."""
    loop = SimpleNamespace(queue=[object()] * queued, lanes=[object()] * running)
    return SimpleNamespace(loop=loop, engine=SimpleNamespace(describe=lambda: describe or {}))


def stats(model: str, kv_used: int, cached: int, capacity: int) -> TickStats:
    return TickStats(model=model, seconds=0.01, prefill_tokens=0, decode_tokens=0, prefill_budget=0,
                     decode_grant=0, lanes_busy=0, max_lanes=4, queue_depth=0, stopped_early=False,
                     kv_used=kv_used, kv_capacity=capacity, first_tokens=[], finished=[], queue_by_class={},
                     lanes_by_class={}, cached_tokens=cached)


def scrape(metrics: Metrics) -> dict[tuple, float]:
    text = metrics.render().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_queue_and_lanes_are_read_when_scraped_not_after_a_tick():
    metrics, models = Metrics(), {"m": runtime()}
    metrics.serve_models(lambda: models)
    got = scrape(metrics)
    assert got[(WAITING, (("model_name", "m"),))] == 0
    assert got[(RUNNING, (("model_name", "m"),))] == 0
    assert got[(KV_USAGE, (("model_name", "m"),))] == 0  # idle, before any tick: nothing held
    models["m"] = runtime(queued=3, running=2)  # requests arrived; no tick has ended since
    got = scrape(metrics)
    assert got[(WAITING, (("model_name", "m"),))] == 3
    assert got[(RUNNING, (("model_name", "m"),))] == 2


def test_kv_usage_counts_what_lanes_hold_not_the_prefix_cache():
    metrics = Metrics()
    metrics.serve_models(lambda: {"m": runtime(running=1)})
    metrics.tick_done("m", stats("m", kv_used=600, cached=200, capacity=1000))
    assert scrape(metrics)[(KV_USAGE, (("model_name", "m"),))] == 0.4
    metrics.tick_done("m", stats("m", kv_used=500, cached=500, capacity=1000))  # idle, cache kept
    assert scrape(metrics)[(KV_USAGE, (("model_name", "m"),))] == 0
    # a shared pool counts shared cells twice (an upper bound): never above 1
    metrics.tick_done("m", stats("m", kv_used=2500, cached=0, capacity=1000))
    assert scrape(metrics)[(KV_USAGE, (("model_name", "m"),))] == 1


def test_cache_config_info_cells_in_blocks_and_an_engine_with_pages():
    metrics = Metrics()
    metrics.serve_models(lambda: {"cells": runtime(), "paged": runtime(describe={"block_size": 32})})
    labels = {s.labels["model_name"]: s.labels for f in text_string_to_metric_families(metrics.render().decode())
              if f.name == CACHE_INFO for s in f.samples}
    assert labels["cells"]["num_gpu_blocks"] == "0"  # the pool's size is known after the first tick
    metrics.tick_done("cells", stats("cells", kv_used=0, cached=0, capacity=8192))
    metrics.tick_done("paged", stats("paged", kv_used=0, cached=0, capacity=4096))
    got = scrape(metrics)
    assert got[(CACHE_INFO, (("block_size", str(CELL_BLOCK_TOKENS)), ("model_name", "cells"),
                             ("num_gpu_blocks", str(8192 // CELL_BLOCK_TOKENS))))] == 1
    assert got[(CACHE_INFO, (("block_size", "32"), ("model_name", "paged"), ("num_gpu_blocks", "128")))] == 1


def test_cells_use_the_kv_events_block_size_when_given():
    metrics = Metrics()
    metrics.serve_models(lambda: {"m": runtime()}, cell_block=64)
    metrics.tick_done("m", stats("m", kv_used=0, cached=0, capacity=2048))
    assert scrape(metrics)[(CACHE_INFO, (("block_size", "64"), ("model_name", "m"), ("num_gpu_blocks", "32")))] == 1


def test_an_unloaded_model_leaves_the_exposition():
    metrics, models = Metrics(), {"a": runtime(queued=1), "b": runtime()}
    metrics.serve_models(lambda: models)
    assert (WAITING, (("model_name", "a"),)) in scrape(metrics)
    del models["a"]
    got = scrape(metrics)
    assert (WAITING, (("model_name", "a"),)) not in got
    assert got[(WAITING, (("model_name", "b"),))] == 0
