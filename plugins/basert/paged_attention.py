"""Paged attention for one engine step: the rows' k/v go into the pool's blocks, then each row's
queries attend over its slot's keys ``[0, start + count)``.

A step mixes decode rows (one token each, often many) with prefill chunks and speculative verify
rows (several tokens). The decode rows are batched into few attention calls, padded to the
longest row of each with a boolean mask, because one call over R rows costs far less than R
calls; each
multi-token row gets its own call with a causal mask offset by its start, because its query
count and key span differ from every other row's and padding them together would waste more than
it saves. Everything the layers share (where each token is written, which blocks each row reads,
the masks) is worked out once per step in ``StepView`` and reused by every layer.

The math is plain ``torch.nn.functional.scaled_dot_product_attention`` on gathered blocks, so
the same code runs on CPU, CUDA and MPS; a softcap (Gemma 2 style ``tanh(x / c) * c`` on the
logits) needs the logits themselves, so it takes a manual softmax path instead.

The store behind the blocks is duck-typed (``kv_blocks.DenseBlocks`` or
``kv_quant.QuantBlocks``): ``write(layer, kv, plan, x)`` and ``read(layer, kv, block_ids)``, and
``rotation``: None, or the orthogonal matrix the stored rows were multiplied by, which the
queries are multiplied by too and the output multiplied back from (``kv_quant`` says why).
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
    rotation: Tensor | None

    def write(self, layer: int, kv: int, plan: WritePlan, x: Tensor) -> None: ...

    def read(self, layer: int, kv: int, block_ids: Tensor) -> Tensor: ...


def attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, *, scale: float,
              softcap: float | None) -> Tensor:
    """Masked attention, the one implementation every row shape goes through.

    q ``[B, Hq, Tq, D]``, k/v ``[B, Hk, Tk, D]`` with ``Hq`` a multiple of ``Hk`` (GQA: query head
    h reads kv head ``h // (Hq // Hk)``), mask ``[B, 1, Tq, Tk]`` boolean, True where visible
    (every query must see at least one key), or None for plain causal with ``Tq == Tk`` (a
    prompt's first chunk: no mask to build, and kernels skip the masked half). Returns
    ``[B, Hq, Tq, D]`` in q's dtype."""
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                              scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    if mask is None:
        n = q.shape[2]
        mask = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    rep = q.shape[1] // k.shape[1]
    if rep > 1:
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
    # fp32 logits: tanh and softmax of bf16 logits lose too much on long rows
    logits = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    logits = torch.tanh(logits / softcap) * softcap
    logits = logits.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(logits, dim=-1), v.float()).to(q.dtype)


def visible(qpos: Tensor, kpos: Tensor, window: int | None) -> Tensor:
    """``[B, 1, Tq, Tk]`` mask from absolute positions, ``qpos [B, Tq]`` and ``kpos [B, Tk]``:
    key j is visible to query i iff j <= i and, with a window, i - j < window. Gathered padding
    sits past a row's last query, so the causal test hides it too."""
    diff = qpos[:, :, None] - kpos[:, None, :]
    mask = diff >= 0
    if window is not None:
        mask &= diff < window
    return mask[:, None]


@dataclass(frozen=True)
class _Call:
    """One attention call of a step, for one window value: the tokens of the flat T it answers
    (a LongTensor of decode rows, or a slice for one multi-token row), the blocks it gathers
    ``[R, nb]``, how many gathered keys per row it keeps, and its mask (None: causal from 0)."""

    tok: Tensor | slice
    blocks: Tensor
    n_keys: int
    mask: Tensor | None
    decode: bool


class StepView:
    """One step's attention over the pool: the object the model's ``attend`` calls go to.

    ``rows`` are ``(slot, start, count)`` in the order of the flat T; ``offsets[i]`` is row i's
    first token in it and ``positions`` each token's position in its slot (for RoPE). Built by
    ``PagedKV.begin_step`` after ``reserve``; ``tables[i]`` is row i's block table. When the last
    layer has attended, ``on_done`` tells the pool the rows' KV is complete.

    Reads gather whole blocks; with a window only the blocks the window reaches. Decode rows are
    sorted by how many blocks they read and batched so that one call gathers at most
    ``max_gather_tokens`` key rows (padding included): the gathered K/V is transient memory, and
    similar lengths together waste little on padding."""

    def __init__(self, *, store: BlockStore, rows: list[tuple[int, int, int]],
                 tables: list[list[int]], n_layers: int, device: torch.device,
                 on_done: Callable[[], None], max_gather_tokens: int = 1 << 16) -> None:
        self.rows = list(rows)
        self.n_layers = n_layers
        self._store = store
        self._device = device
        self._on_done = on_done
        self._done = False
        self._budget = max_gather_tokens
        bs = store.block_size
        self.offsets: list[int] = []
        positions: list[int] = []
        flat: list[int] = []
        wblocks: list[int] = []
        fill: list[int] = []
        prior: list[bool] = []
        local: list[int] = []
        self._dec: list[tuple[int, int, list[int]]] = []        # (offset, start, table)
        self._mul: list[tuple[int, int, int, list[int]]] = []   # (offset, start, count, table)
        off = 0
        for (slot, start, count), table in zip(self.rows, tables):
            self.offsets.append(off)
            end = start + count
            first_w = len(wblocks)
            for bi in range(start // bs, _ceil_div(end, bs) if count else start // bs):
                wblocks.append(table[bi])
                fill.append(min(bs, end - bi * bs))
                prior.append(bi * bs < start)
            for p in range(start, end):
                flat.append(table[p // bs] * bs + p % bs)
                local.append((first_w + p // bs - start // bs) * bs + p % bs)
                positions.append(p)
            if count == 1:
                self._dec.append((off, start, table))
            elif count > 1:
                self._mul.append((off, start, count, table))
            off += count
        self.n_tokens = off
        self.positions = self._long(positions)
        self.plan = WritePlan(flat=self._long(flat), blocks=self._long(wblocks),
                              local=self._long(local), fill=self._long(fill),
                              prior=torch.tensor(prior, dtype=torch.bool, device=device))
        self._calls: dict[int | None, list[_Call]] = {}

    def _long(self, xs: list) -> Tensor:
        return torch.tensor(xs, dtype=torch.long, device=self._device)

    def _plan(self, window: int | None) -> list[_Call]:
        """The step's attention calls for one window value, built on the first layer that uses
        it (sliding and global layers differ) and reused by the others."""
        got = self._calls.get(window)
        if got is not None:
            return got
        bs = self._store.block_size
        first = (lambda start: 0) if window is None else (
            lambda start: max(0, start - window + 1) // bs)
        calls: list[_Call] = []
        spans = sorted((start // bs + 1 - first(start), off, start, table)
                       for off, start, table in self._dec)
        group: list[tuple[int, int, int, list[int]]] = []
        for i, span in enumerate(spans):
            group.append(span)
            nxt = spans[i + 1] if i + 1 < len(spans) else None
            if nxt is None or (len(group) + 1) * nxt[0] * bs > self._budget:
                calls.append(self._decode_call(group, first, window))
                group = []
        for off, start, count, table in self._mul:
            lo, end = first(start), start + count
            kpos = torch.arange(lo * bs, end, device=self._device)[None]
            qpos = torch.arange(start, end, device=self._device)[None]
            plain = start == 0 and window is None
            calls.append(_Call(tok=slice(off, off + count),
                               blocks=self._long(table[lo:_ceil_div(end, bs)])[None],
                               n_keys=end - lo * bs,
                               mask=None if plain else visible(qpos, kpos, window),
                               decode=False))
        self._calls[window] = calls
        return calls

    def _decode_call(self, group: list[tuple[int, int, int, list[int]]],
                     first: Callable[[int], int], window: int | None) -> _Call:
        bs = self._store.block_size
        nb = group[-1][0]                      # sorted: the last row reads the most blocks
        blocks, base = [], []
        for n, _, start, table in group:
            lo = first(start)
            # pad with block 0: any block will do, its keys sit past the row's query
            blocks.append(table[lo:lo + n] + [0] * (nb - n))
            base.append(lo * bs)
        kpos = self._long(base)[:, None] + torch.arange(nb * bs, device=self._device)[None]
        qpos = self._long([start for _, _, start, _ in group])[:, None]
        return _Call(tok=self._long([off for _, off, _, _ in group]), blocks=self._long(blocks),
                     n_keys=nb * bs, mask=visible(qpos, kpos, window), decode=True)

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
        rot = store.rotation
        if rot is not None:  # attend in the stored rows' basis, then come back
            q = (q.float() @ rot).to(q.dtype)
        out = torch.empty_like(q)
        for call in self._plan(window):
            keys = store.read(layer, 0, call.blocks)          # [R, nb, bs, Hk, D]
            vals = store.read(layer, 1, call.blocks)
            r = keys.shape[0]
            keys = keys.reshape(r, -1, *keys.shape[-2:])[:, :call.n_keys].transpose(1, 2)
            vals = vals.reshape(r, -1, *vals.shape[-2:])[:, :call.n_keys].transpose(1, 2)
            if call.decode:
                qq = q[call.tok].unsqueeze(2)                  # [R, Hq, 1, D]
            else:
                qq = q[call.tok].transpose(0, 1)[None]         # [1, Hq, count, D]
            o = attention(qq, keys.to(q.dtype), vals.to(q.dtype), call.mask, scale=scale,
                          softcap=softcap)
            if call.decode:
                out[call.tok] = o[:, :, 0]
            else:
                out[call.tok] = o[0].transpose(0, 1)
        if layer == self.n_layers - 1 and not self._done:
            self._done = True
            self._on_done()
        if rot is not None:
            out = (out.float() @ rot.T).to(out.dtype)
        return out


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)
