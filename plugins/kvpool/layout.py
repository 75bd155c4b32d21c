"""The KV pool's layout: how many sequences and cells a context gets, and which limit decided it.

Plain attention gets a KV buffer of max-context cells per sequence, lanes + 2 sequences
(4..256), so a step attends only over its own sequence; the two beyond the lanes are spare
slots, where the most recently finished conversations stay in the pool. Sliding-window and
recurrent models (and any model with ``shared`` forced, --kv-unified) share one pool of
``pool_cells`` if given (--kv-pool-cells), else lanes × max-context cells capped at ``fraction``
(60 %) of the memory the weights leave free on the device that holds them; never fewer than
max-context, so one lane always fits. The spec's words: "The shared pool is max-batch ×
max-context cells capped at 60% of the device memory the weights leave free."
"""

from __future__ import annotations

from typing import Callable

import attrs

# which limit set a layout's cells
PER_SEQUENCE = "per-sequence"    # max-context cells a sequence, never capped
LANES = "lanes"                  # lanes × max-context fitted under the memory cap
MEMORY = "memory"                # the memory cap cut lanes × max-context down
ONE_LANE = "one-lane"            # the cap left less than one lane: max-context anyway
POOL_CELLS = "pool-cells"        # --kv-pool-cells


@attrs.frozen
class FreeMemory:
    """Memory the weights leave free where they sit, and where that is (``host``, or a GPU's
    name) and how it was measured."""

    free_bytes: int
    where: str = "host"
    how: str = ""


@attrs.frozen
class PoolLayout:
    """A context's KV layout and what decided it (the worker's load line, /health and /metrics)."""

    n_seq: int
    n_ctx: int
    unified: bool
    bytes_per_cell: int
    cap: str
    memory: FreeMemory
    fraction: float

    @property
    def budget_bytes(self) -> int:
        """The share of free memory a shared pool may take."""
        return int(self.memory.free_bytes * self.fraction)

    def describe(self, n_ctx: int | None = None, kv_bytes: int | None = None) -> dict:
        """The layout as plain data; ``n_ctx`` / ``kv_bytes``: what the engine really allocated."""
        cells = self.n_ctx if n_ctx is None else n_ctx
        return {"sequences": self.n_seq, "cells": cells, "shared": self.unified,
                "bytes_per_cell": self.bytes_per_cell,
                "kv_bytes": cells * self.bytes_per_cell if kv_bytes is None else kv_bytes,
                "cap": self.cap, "fraction": self.fraction, "free_bytes": self.memory.free_bytes,
                "budget_bytes": self.budget_bytes, "memory": self.memory.where, "memory_how": self.memory.how}

    def line(self, n_ctx: int | None = None, kv_bytes: int | None = None) -> str:
        """One line for the load log."""
        d = self.describe(n_ctx, kv_bytes)
        head = (f"{d['kv_bytes'] / 2**20:.1f} MiB KV in {'one shared pool' if self.unified else 'per-sequence buffers'}: "
                f"{d['sequences']} sequences, {d['cells']} cells × {self.bytes_per_cell} bytes")
        if not self.unified:
            return head + " (max-context cells a sequence, not capped)"
        limit = {LANES: "lanes × max-context, within", MEMORY: "capped at", ONE_LANE: "one lane, though above",
                 POOL_CELLS: "--kv-pool-cells; not capped at"}[self.cap]
        return (f"{head} ({limit} {self.fraction:.0%} of {self.memory.free_bytes / 2**30:.2f} GiB free on "
                f"{self.memory.where} = {self.budget_bytes / 2**30:.2f} GiB)")


def sequences(n_lanes: int) -> int:
    """Lanes + 2 sequences, 4..256."""
    return min(max(n_lanes + 2, 4), 256)


def decide(n_lanes: int, max_context: int, shared: bool, bytes_per_cell: int, memory: FreeMemory,
           fraction: float = 0.6, pool_cells: int = 0,
           cells_within: Callable[[int], int] | None = None) -> PoolLayout:
    """The layout for ``n_lanes`` lanes of ``max_context``; ``cells_within(budget)``: the most
    cells whose KV fits ``budget`` bytes (default ``budget // bytes_per_cell``)."""
    n_seq = sequences(n_lanes)
    if not shared:
        return PoolLayout(n_seq, n_seq * max_context, False, bytes_per_cell, PER_SEQUENCE, memory, fraction)
    if pool_cells:
        return PoolLayout(n_seq, max(pool_cells, max_context), True, bytes_per_cell, POOL_CELLS, memory, fraction)
    wanted = n_lanes * max_context
    cap = LANES
    if bytes_per_cell > 0:
        budget = int(memory.free_bytes * fraction)
        fits = cells_within(budget) if cells_within else budget // bytes_per_cell
        if fits < wanted:
            wanted, cap = fits, MEMORY
    if wanted < max_context:
        wanted, cap = max_context, ONE_LANE
    return PoolLayout(n_seq, wanted, True, bytes_per_cell, cap, memory, fraction)


def host_free(mapped_weight_bytes: int = 0) -> FreeMemory:
    """Host memory the weights leave free: the kernel's available memory, less the weights held
    in a file mapping (their pages count as reclaimable cache there, but the model needs them)."""
    import psutil

    available = psutil.virtual_memory().available
    how = "psutil available"
    if mapped_weight_bytes:
        how += f" less {mapped_weight_bytes / 2**20:.0f} MiB of mapped weights"
    return FreeMemory(max(0, available - mapped_weight_bytes), "host", how)
