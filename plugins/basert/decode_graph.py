"""Decode-only steps at fixed batch sizes, replayed as CUDA graphs.

Why: a decode step of a small batch is bound by launch overhead, not by the GPU. Each layer
is a few dozen kernels, and Python issues them one by one, so at batch 1 an 8B model spends more
time launching kernels than reading its weights. A captured graph launches the whole forward at
once. It needs fixed shapes and addresses, so a step's rows are padded up to a *bucket* (1, 2, 4,
8, ... up to the lane count), and the attention is ``paged_decode.PagedDecode``, whose tensors are
all fixed for its bucket.

Each bucket is captured once, at startup (``warm_up``). Before capture, a warm-up forward on a
side stream compiles FlexAttention's kernel and settles the allocator; that forward runs on
padding rows only, which write nothing but the scratch block. All buckets share one graph memory
pool. Without graphs (the CPU, or ``--cuda-graphs off``) the same bucket runs eagerly, which is
what the tests compare with the gather path."""

from __future__ import annotations

import logging
import time

import torch
from torch import Tensor

from .paged_decode import PagedDecode

log = logging.getLogger("superfluid.basert")


def buckets_for(max_lanes: int) -> list[int]:
    """Powers of two below ``max_lanes``, then ``max_lanes`` itself."""
    out, b = [], 1
    while b < max_lanes:
        out.append(b)
        b *= 2
    return out + [max_lanes]


class _Bucket:
    def __init__(self, decode: PagedDecode) -> None:
        self.decode = decode
        self.graph: torch.cuda.CUDAGraph | None = None
        self.hidden: Tensor | None = None  # the graph's output, overwritten by each replay


class DecodeGraphs:
    """Runs decode-only steps of ``model`` over ``pool`` (16-bit pages, with a scratch block)
    through :class:`PagedDecode` buckets; with ``graphs``, each bucket is a CUDA graph."""

    def __init__(self, model, pool, *, max_lanes: int, max_context: int, graphs: bool) -> None:
        if pool.scratch_block is None or pool.bits:
            raise ValueError("decode graphs need a 16-bit pool with a scratch block")
        if graphs and pool.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, not {pool.device}")
        self.model, self.pool, self.graphs = model, pool, graphs
        max_blocks = -(-max_context // pool.block_size)
        windows = set(model.shape.windows)
        self.buckets = {b: _Bucket(PagedDecode(pool.store, batch=b, max_blocks=max_blocks,
                                               scratch=pool.scratch_block, windows=windows,
                                               device=pool.device))
                        for b in buckets_for(max_lanes)}
        self._mempool = None

    @property
    def max_rows(self) -> int:
        return max(self.buckets)

    def bucket(self, n: int) -> int:
        return min(b for b in self.buckets if b >= n)

    def warm_up(self) -> float:
        """Make every bucket ready now, so that no tick pays for it: with graphs, capture them;
        without, run each once on padding (which compiles FlexAttention's kernel on CUDA). The
        seconds it took."""
        t0 = time.perf_counter()
        if not self.graphs:
            for bucket in self.buckets.values():
                bucket.decode.load([], [], [])
                self._forward(bucket)
            return time.perf_counter() - t0
        self._mempool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream(self.pool.device)
        for size in sorted(self.buckets, reverse=True):  # the largest first: the pool's high mark
            bucket = self.buckets[size]
            bucket.decode.load([], [], [])
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):
                    self._forward(bucket)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._mempool):
                bucket.hidden = self._forward(bucket)
            bucket.graph = graph
        torch.cuda.synchronize(self.pool.device)
        return time.perf_counter() - t0

    def _forward(self, bucket: _Bucket) -> Tensor:
        d = bucket.decode
        d.prepare()
        return self.model(d.tokens, d.positions, d)

    def hidden(self, tokens: list[int], positions: list[int], tables: list[list[int]]) -> Tensor:
        """Final hidden states ``[n, hidden]`` of ``n`` decode rows (token, position, block table
        each; reserved in the pool). Valid until the next call."""
        n = len(tokens)
        bucket = self.buckets[self.bucket(n)]
        bucket.decode.load(tokens, positions, tables)
        if bucket.graph is not None:
            bucket.graph.replay()
            return bucket.hidden[:n]
        return self._forward(bucket)[:n]
