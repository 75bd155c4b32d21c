"""Paged attention for one engine step: the rows' k/v go into the pool's blocks, then each row's
queries attend over its slot's keys ``[0, start + count)``.

A step mixes decode rows (one token each, often many) with prefill chunks and speculative verify
rows (several tokens). The decode rows are batched into one attention call, padded to the longest
slot with a boolean mask, because one call over R rows costs far less than R calls; each
multi-token row gets its own call with a causal mask offset by its start, because its query
count and key span differ from every other row's and padding them together would waste more than
it saves. Everything the layers share (where each token is written, which blocks each row reads,
the masks) is worked out once per step in ``StepView`` and reused by every layer.

The math is plain ``torch.nn.functional.scaled_dot_product_attention`` on gathered blocks, so
the same code runs on CPU, CUDA and MPS; a softcap (Gemma 2 style ``tanh(x / c) * c`` on the
logits) needs the logits themselves, so it takes a manual softmax path instead.

The store behind the blocks is duck-typed (``kv_pool.DenseBlocks`` or
``kv_quant.QuantBlocks``): ``write(layer, kv, plan, x)`` and ``read(layer, kv, block_ids)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor


@dataclass(frozen=True)
class WritePlan:
    """Where a step's T tokens land in the pool, as index tensors shared by all layers.

    ``flat``: ``block * block_size + offset`` per token, for stores that write rows in place.
    ``blocks``/``local``/``fill``/``prior``: for stores that rewrite whole blocks (quantized
    ones): the distinct blocks written, each token's row in a ``[W * block_size]`` buffer of those
    blocks, how many rows of each block are valid after the write, and whether the block already
    held valid rows before it (so its old scale still bounds them)."""

    flat: Tensor
    blocks: Tensor
    local: Tensor
    fill: Tensor
    prior: Tensor


class BlockStore(Protocol):
    """What the step needs from the pool's storage."""

    block_size: int

    def write(self, layer: int, kv: int, plan: WritePlan, x: Tensor) -> None: ...

    def read(self, layer: int, kv: int, block_ids: Tensor) -> Tensor: ...


def attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, *, scale: float,
              softcap: float | None) -> Tensor:
    """Masked attention, the one implementation every row shape goes through.

    q ``[B, Hq, Tq, D]``, k/v ``[B, Hk, Tk, D]`` with ``Hq`` a multiple of ``Hk`` (GQA: query head
    h reads kv head ``h // (Hq // Hk)``), mask ``[B, 1, Tq, Tk]`` boolean, True where visible;
    every query must see at least one key. Returns ``[B, Hq, Tq, D]`` in q's dtype."""
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                              enable_gqa=q.shape[1] != k.shape[1])
    rep = q.shape[1] // k.shape[1]
    if rep > 1:
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
    # fp32 logits: tanh and softmax of bf16 logits lose too much on long rows
    logits = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    logits = torch.tanh(logits / softcap) * softcap
    logits = logits.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(logits, dim=-1), v.float()).to(q.dtype)


def visible(qpos: Tensor, n_keys: int, window: int | None) -> Tensor:
    """``[B, 1, Tq, n_keys]`` mask: key j is visible to the query at position i iff j <= i and,
    with a window, i - j < window. ``qpos`` is ``[B, Tq]``; keys past a row's end are hidden by
    the causal test (a row's keys end right after its last query)."""
    kpos = torch.arange(n_keys, device=qpos.device)
    diff = qpos[:, :, None] - kpos[None, None, :]
    mask = diff >= 0
    if window is not None:
        mask &= diff < window
    return mask[:, None]


@dataclass(frozen=True)
class _Multi:
    """One multi-token row: its tokens ``[off, off + count)`` in the flat T, its queries'
    positions ``[1, count]``, the blocks covering its keys and the key count."""

    off: int
    count: int
    qpos: Tensor
    blocks: Tensor
    n_keys: int


class StepView:
    """One step's attention over the pool: the object the model's ``attend`` calls go to.

    ``rows`` are ``(slot, start, count)`` in the order of the flat T; ``offsets[i]`` is row i's
    first token in it and ``positions`` each token's position in its slot (for RoPE). Built by
    ``PagedKV.begin_step`` after ``reserve``; ``tables[i]`` is row i's block table. When the last
    layer has attended, ``on_done`` tells the pool the rows' KV is complete."""

    def __init__(self, *, store: BlockStore, rows: list[tuple[int, int, int]],
                 tables: list[list[int]], n_layers: int, device: torch.device,
                 on_done: Callable[[], None]) -> None:
        self.rows = list(rows)
        self.n_layers = n_layers
        self._store = store
        self._on_done = on_done
        self._done = False
        bs = store.block_size
        self.offsets: list[int] = []
        positions: list[int] = []
        flat: list[int] = []
        wblocks: list[int] = []
        fill: list[int] = []
        prior: list[bool] = []
        local: list[int] = []
        dec_tok: list[int] = []
        dec_pos: list[int] = []
        dec_tables: list[list[int]] = []
        self._multi: list[_Multi] = []
        off = 0
        for (slot, start, count), table in zip(self.rows, tables):
            self.offsets.append(off)
            end = start + count
            for p in range(start, end):
                blk = table[p // bs]
                flat.append(blk * bs + p % bs)
                positions.append(p)
            first_w = len(wblocks)
            for bi in range(start // bs, (end - 1) // bs + 1 if count else start // bs):
                wblocks.append(table[bi])
                fill.append(min(bs, end - bi * bs))
                prior.append(bi * bs < start)
            for p in range(start, end):
                local.append((first_w + p // bs - start // bs) * bs + p % bs)
            n_blk = -(-end // bs)
            if count == 1:
                dec_tok.append(off)
                dec_pos.append(start)
                dec_tables.append(table[:n_blk])
            elif count > 1:
                self._multi.append(_Multi(
                    off=off, count=count,
                    qpos=torch.arange(start, end, device=device)[None],
                    blocks=torch.tensor(table[:n_blk], dtype=torch.long, device=device),
                    n_keys=end))
            off += count
        self.n_tokens = off
        as_long = lambda xs: torch.tensor(xs, dtype=torch.long, device=device)  # noqa: E731
        self.positions = as_long(positions)
        self.plan = WritePlan(flat=as_long(flat), blocks=as_long(wblocks), local=as_long(local),
                              fill=as_long(fill),
                              prior=torch.tensor(prior, dtype=torch.bool, device=device))
        self._dec_tok = as_long(dec_tok)
        self._dec_qpos = as_long(dec_pos)[:, None]
        nb = max((len(t) for t in dec_tables), default=0)
        # pad with block 0: any block will do, the mask hides it
        self._dec_blocks = as_long([t + [0] * (nb - len(t)) for t in dec_tables]).view(len(dec_tables), nb)
        self._masks: dict[tuple[int, int | None], Tensor] = {}

    def _mask(self, key: int, qpos: Tensor, n_keys: int, window: int | None) -> Tensor:
        """Masks depend on the window, which varies by layer (sliding vs global): one per
        (row group, window) per step."""
        got = self._masks.get((key, window))
        if got is None:
            got = self._masks[(key, window)] = visible(qpos, n_keys, window)
        return got

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor, *, window: int | None,
               scale: float, softcap: float | None) -> Tensor:
        """Store this layer's k/v ``[T, Hk, D]`` at the rows' positions, then attend q
        ``[T, Hq, D]`` (RoPE applied, not pre-scaled) over each row's slot. Returns
        ``[T, Hq, D]``."""
        if q.shape[0] != self.n_tokens or k.shape[0] != self.n_tokens:
            raise ValueError(f"step has {self.n_tokens} tokens, got q {tuple(q.shape)} "
                             f"k {tuple(k.shape)}")
        store = self._store
        if self.n_tokens:
            store.write(layer, 0, self.plan, k)
            store.write(layer, 1, self.plan, v)
        out = torch.empty_like(q)
        bs = store.block_size
        if self._dec_tok.numel():
            r, nb = self._dec_blocks.shape
            keys = store.read(layer, 0, self._dec_blocks)     # [R, nb, bs, Hk, D]
            vals = store.read(layer, 1, self._dec_blocks)
            keys = keys.reshape(r, nb * bs, *keys.shape[-2:]).transpose(1, 2)
            vals = vals.reshape(r, nb * bs, *vals.shape[-2:]).transpose(1, 2)
            qq = q[self._dec_tok].unsqueeze(2)                 # [R, Hq, 1, D]
            mask = self._mask(-1, self._dec_qpos, nb * bs, window)
            o = attention(qq, keys.to(q.dtype), vals.to(q.dtype), mask, scale=scale,
                          softcap=softcap)
            out[self._dec_tok] = o[:, :, 0]
        for i, row in enumerate(self._multi):
            keys = store.read(layer, 0, row.blocks)              # [nb, bs, Hk, D]
            vals = store.read(layer, 1, row.blocks)
            keys = keys.reshape(-1, *keys.shape[-2:])[:row.n_keys].transpose(0, 1)[None]
            vals = vals.reshape(-1, *vals.shape[-2:])[:row.n_keys].transpose(0, 1)[None]
            qq = q[row.off:row.off + row.count].transpose(0, 1)[None]
            mask = self._mask(i, row.qpos, row.n_keys, window)
            o = attention(qq, keys.to(q.dtype), vals.to(q.dtype), mask, scale=scale,
                          softcap=softcap)
            out[row.off:row.off + row.count] = o[0].transpose(0, 1)
        if layer == self.n_layers - 1 and not self._done:
            self._done = True
            self._on_done()
        return out
