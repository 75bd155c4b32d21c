"""Decode rows' attention read in place from the pool's pages with FlexAttention, at a fixed
batch size: the attention a decode-only step runs on CUDA, and the part of it a CUDA graph holds.

Why not the gather path (``paged_attention.StepView``): it copies every row's blocks out of the
pool in every layer, then runs SDPA on the copy. On a GPU that copy is as much memory traffic as
the attention itself. FlexAttention's decoding kernel reads the pages where they lie; a
``BlockMask`` built from the block tables tells it which blocks each row reads. Only a row's first
and last block are masked element by element (its length ends in the last one, a sliding window
begins in the first); the blocks between are read whole.

Why a fixed batch size (a *bucket*): every tensor here has a fixed shape and address, and
everything per step is derived on the device from one packed buffer (token, position, block table
per row) that :meth:`PagedDecode.load` fills with one host-to-device copy. So the whole decode
forward can be captured once and replayed (``decode_graph``). Rows past the step's real ones are
padding: they write their K/V into the pool's scratch block, which no slot is ever given, and
read only that block.

The mask function is exact on its own (a key is visible iff its block is in the row's table and
its position is at or before the row's, within the window), so the CPU's unfused FlexAttention,
which evaluates it over the whole pool and ignores the block lists, computes the same attention
as the compiled kernel, which evaluates it only on the partial blocks. The tests check it on the
CPU; ``tools/gpu/check.py`` checks the compiled kernel and the graphs on a GPU."""

from __future__ import annotations

import warnings
from functools import lru_cache

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask, flex_attention

Q_TILE = 128
"""FlexAttention's query tile: one tile covers a decode row's single query (its GQA group too)."""

_FAR = 1 << 30
"""The logical index of a block no row reads: its positions lie past every row's."""


@lru_cache(maxsize=None)
def flex_kernel(device_type: str, compiled: bool | None = None):
    """FlexAttention as it runs on ``device_type``: compiled by default on CUDA (a fused Triton
    kernel that reads only the listed blocks); elsewhere unfused (it evaluates the mask over the
    whole pool: correct, and only a reference there). ``compiled`` overrides the default: the
    tests compile it on the CPU (inductor's C++ kernel, which reads the block lists too)."""
    if compiled is None:
        compiled = device_type == "cuda"
    if compiled:
        import torch._dynamo

        # one compiled kernel per bucket and window (their masks close over their own tensors):
        # past dynamo's default of 8 it would fall back to the unfused path, silently slow
        for knob in ("recompile_limit", "cache_size_limit"):
            if hasattr(torch._dynamo.config, knob):
                setattr(torch._dynamo.config, knob, max(getattr(torch._dynamo.config, knob), 256))
        return torch.compile(flex_attention, dynamic=False, fullgraph=True)

    def unfused(*args, **kwargs):
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
            return flex_attention(*args, **kwargs)

    return unfused


@lru_cache(maxsize=None)
def _softcapped(cap: float | None):
    """Gemma 2's logit soft-cap as a FlexAttention score_mod, one function per cap (a new closure
    per call would make the compiled kernel recompile)."""
    if cap is None:
        return None

    def score_mod(score, b, h, q_idx, kv_idx):
        return torch.tanh(score / cap) * cap

    return score_mod


class _Mask:
    """The block lists and element mask of one window value (None: global layers), in tensors
    filled in place by :meth:`PagedDecode.prepare` and read by the BlockMask built over them."""

    def __init__(self, owner: "PagedDecode", window: int | None) -> None:
        b, dev = owner.batch, owner.device
        # the lists are as long as the pool has blocks (inductor's lowering asks that the mask
        # cover the whole key length); only their first kv_num / full_num entries are read
        width = max(owner.n_cells // owner.block_size, 2)
        self.window = window
        self.first = torch.zeros(b, dtype=torch.long, device=dev)      # first visible position
        self.kv_num = torch.zeros(b, 1, 1, dtype=torch.int32, device=dev)
        self.kv_idx = torch.zeros(b, 1, 1, width, dtype=torch.int32, device=dev)
        self.full_num = torch.zeros(b, 1, 1, dtype=torch.int32, device=dev)
        self.full_idx = torch.zeros(b, 1, 1, width, dtype=torch.int32, device=dev)
        bs, inv, pos, first = owner.block_size, owner.inverse, owner.query_pos, self.first

        def visible(b, h, q_idx, kv_idx):
            kpos = inv[b, kv_idx // bs] * bs + kv_idx % bs
            return (kpos <= pos[b]) & (kpos >= first[b])

        args = dict(BLOCK_SIZE=(Q_TILE, bs), mask_mod=visible, seq_lengths=(1, owner.n_cells))
        try:  # no transposed (backward) lists: inference only
            self.block_mask = BlockMask.from_kv_blocks(self.kv_num, self.kv_idx, self.full_num, self.full_idx,
                                                       compute_q_blocks=False, **args)
        except TypeError:  # a torch without compute_q_blocks builds them: unused, and harmless
            self.block_mask = BlockMask.from_kv_blocks(self.kv_num, self.kv_idx, self.full_num, self.full_idx,
                                                       **args)

    def prepare(self, owner: "PagedDecode") -> None:
        bs, table, pos = owner.block_size, owner.table, owner.positions
        nb = table.shape[1]
        if self.window is None:
            self.first.zero_()
        else:
            torch.clamp(pos - (self.window - 1), min=0, out=self.first)
        lo, hi = self.first // bs, pos // bs                           # first and last block read
        one = (hi == lo).to(torch.int32)
        self.kv_num[:, 0, 0] = 2 - one
        self.kv_idx[:, 0, 0, 0] = table.gather(1, lo[:, None])[:, 0].to(torch.int32)
        self.kv_idx[:, 0, 0, 1] = table.gather(1, hi[:, None])[:, 0].to(torch.int32)
        self.full_num[:, 0, 0] = (hi - lo - 1).clamp(min=0).to(torch.int32)
        between = (lo[:, None] + 1 + owner.arange[None, :]).clamp(max=nb - 1)
        self.full_idx[:, 0, 0, :nb] = table.gather(1, between).to(torch.int32)


class PagedDecode:
    """One bucket: ``batch`` decode rows (one token each) over a ``DenseBlocks`` store, as the
    model's attention object (``attend``). ``max_blocks``: the longest block table a row may have
    (the context length in blocks); ``scratch``: the store's block no slot owns; ``windows``: the
    model's distinct sliding windows (None for global layers); ``compiled``: see ``flex_kernel``."""

    def __init__(self, store, *, batch: int, max_blocks: int, scratch: int, windows: set[int | None],
                 device: torch.device, compiled: bool | None = None) -> None:
        self.store, self.batch, self.max_blocks, self.scratch = store, batch, max_blocks, scratch
        self.device = torch.device(device)
        self.block_size = store.block_size
        n_store_blocks = store.data.shape[2]
        self.n_cells = n_store_blocks * self.block_size
        self.packed = torch.zeros(batch, 2 + max_blocks, dtype=torch.long, device=self.device)
        cuda = self.device.type == "cuda"
        self.staging = torch.zeros(self.packed.shape, dtype=torch.long, pin_memory=cuda)
        self._copied = torch.cuda.Event() if cuda else None  # the staging buffer is free again
        self.tokens, self.positions, self.table = self.packed[:, 0], self.packed[:, 1], self.packed[:, 2:]
        self.arange = torch.arange(max_blocks, device=self.device)
        self.inverse = torch.full((batch, n_store_blocks), _FAR, dtype=torch.long, device=self.device)
        self.write_at = torch.zeros(batch, dtype=torch.long, device=self.device)
        self.query_pos = torch.zeros(batch, dtype=torch.long, device=self.device)  # positions, not a view
        self.masks = {w: _Mask(self, w) for w in windows}
        self.kernel = flex_kernel(self.device.type, compiled)
        self.n_rows = 0

    def load(self, tokens: list[int], positions: list[int], tables: list[list[int]]) -> None:
        """The step's rows (at most ``batch``): each one's token, position and block table; the
        rest of the bucket is padding. One copy to the device; ``prepare`` derives the rest."""
        n = len(tokens)
        if n > self.batch:
            raise ValueError(f"{n} rows do not fit a bucket of {self.batch}")
        host = self.staging
        if self._copied is not None:
            self._copied.synchronize()  # the last step's copy has left the buffer
        host[:, :2] = 0
        host[:, 2:] = self.scratch
        for i, (token, pos, table) in enumerate(zip(tokens, positions, tables)):
            if len(table) > self.max_blocks or pos // self.block_size >= len(table):
                raise ValueError(f"row {i}: position {pos} with a table of {len(table)} blocks "
                                 f"(at most {self.max_blocks})")
            host[i, 0], host[i, 1] = token, pos
            host[i, 2:2 + len(table)] = torch.tensor(table, dtype=torch.long)
        self.packed.copy_(host, non_blocking=True)
        if self._copied is not None:
            self._copied.record()
        self.n_rows = n

    def prepare(self) -> None:
        """Derive, on the device, where each row writes and the masks' tensors (static shapes:
        part of the captured graph)."""
        bs, table, pos = self.block_size, self.table, self.positions
        self.write_at.copy_(table.gather(1, (pos // bs)[:, None])[:, 0] * bs + pos % bs)
        self.query_pos.copy_(pos)
        self.inverse.fill_(_FAR)
        # a row's logical index of each physical block; padding entries (the scratch block, past
        # the row's length) keep the smallest index, which for a real row lies past its position
        self.inverse.scatter_reduce_(1, table, self.arange.expand_as(table), reduce="amin")
        for mask in self.masks.values():
            mask.prepare(self)

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor, *, window: int | None,
               scale: float, softcap: float | None) -> Tensor:
        """Write this layer's k/v ``[B, Hk, D]`` at the rows' positions, then attend q
        ``[B, Hq, D]`` over each row's pages in place. Returns ``[B, Hq, D]``."""
        data = self.store.data[layer]
        keys = data[0].view(-1, *data.shape[-2:])                      # [cells, Hk, D]
        vals = data[1].view(-1, *data.shape[-2:])
        keys.index_copy_(0, self.write_at, k.to(keys.dtype))
        vals.index_copy_(0, self.write_at, v.to(vals.dtype))
        out = self.kernel(q.unsqueeze(2), keys.permute(1, 0, 2)[None].to(q.dtype),
                          vals.permute(1, 0, 2)[None].to(q.dtype), score_mod=_softcapped(softcap),
                          block_mask=self.masks[window].block_mask, scale=scale,
                          enable_gqa=q.shape[1] != k.shape[1])
        return out[:, :, 0]
