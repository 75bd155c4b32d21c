"""What llama.cpp says it allocated for a context's KV, read from its log while the context is made.

No API of llama.cpp's reports the KV bytes (``llama_get_memory_breakdown`` is C++ only), but each
KV cache it creates logs ``llama_kv_cache: size = N MiB (C cells, L layers, s/S seqs), K (f16): ...``
(a sliding-window model's context makes two: full-attention and window layers). The worker
collects those lines around ``llama_init_from_model``: its own figure (kvpool.shape) is checked
against them, and they are reported beside it. MiB with two decimals: within 0.005 MiB a cache.
"""

from __future__ import annotations

import contextlib
import ctypes
import re
import sys
from typing import Iterator

import attrs

CACHE_LINE = re.compile(r"llama_kv_cache: size =\s*([0-9.]+) MiB \(\s*(\d+) cells,\s*(\d+) layers,\s*(\d+)/(\d+) seqs\)")
LOG_ERROR = 3  # ggml_log_level GGML_LOG_LEVEL_ERROR
MIB = 1 << 20


@attrs.frozen
class CacheLine:
    """One KV cache llama.cpp made: its size, cells a stream, layers and streams."""

    mib: float
    cells: int
    layers: int
    streams: int

    def describe(self) -> dict:
        return {"mib": self.mib, "cells": self.cells, "layers": self.layers, "streams": self.streams}


def parse(line: str) -> CacheLine | None:
    found = CACHE_LINE.search(line)
    if not found:
        return None
    mib, cells, layers, _seqs, streams = found.groups()
    return CacheLine(float(mib), int(cells), int(layers), int(streams))


def total_bytes(caches: list[CacheLine]) -> int:
    """The caches' size in bytes, as precise as the log's MiB with two decimals."""
    return round(sum(c.mib for c in caches) * MIB)


@contextlib.contextmanager
def kv_caches(into: list[CacheLine]) -> Iterator[None]:
    """Collect the KV caches llama.cpp logs inside the block into ``into``. Errors still reach
    stderr; on leaving, llama-cpp-python's own log callback is put back."""
    import llama_cpp
    from llama_cpp import _logger

    @llama_cpp.llama_log_callback
    def collect(level, text, _user):
        line = text.decode(errors="replace")
        cache = parse(line)
        if cache is not None:
            into.append(cache)
        if level == LOG_ERROR:
            sys.stderr.write(line)

    llama_cpp.llama_log_set(collect, ctypes.c_void_p(0))
    try:
        yield
    finally:
        llama_cpp.llama_log_set(_logger.llama_log_callback, ctypes.c_void_p(0))


def agrees(computed: int, caches: list[CacheLine]) -> bool:
    """Whether a computed size is what the log says, within its rounding (0.005 MiB a cache)."""
    return abs(computed - total_bytes(caches)) <= len(caches) * 0.005 * MIB + 1


def kv_allocated(shape, pool, n_ctx: int, caches: list[CacheLine], n_ubatch: int, v_trans: bool,
                 swa_full: bool = True) -> tuple[int, int, int]:
    """(KV bytes allocated, the log's figure or 0, the shape's figure): the shape's exact figure where
    the log agrees with it (or logged nothing), else the log's (a shape kvpool.shape does not model,
    such as MLA)."""
    computed = shape.allocated_bytes(n_ctx, pool.n_seq, pool.unified, swa_full=swa_full, n_ubatch=n_ubatch,
                                     v_trans=v_trans)
    if not caches:
        return computed, 0, computed
    logged = total_bytes(caches)
    return (computed if agrees(computed, caches) else logged), logged, computed
