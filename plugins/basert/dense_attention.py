"""The plain contiguous-cache attention: basert's reference for tests and the no-paging baseline.

Each sequence owns a ``[max_len]`` slab of K and V per layer, so there is nothing clever to get
wrong: the paged KV pool must produce the same numbers as this. The model calls ``attend`` once
per layer with the step's new q/k/v (RoPE applied, q not pre-scaled); ``begin`` says beforehand
which sequence and positions each flat token belongs to.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .shape import ModelShape


class DenseAttention:
    """Causal (optionally sliding-window, optionally soft-capped) attention over per-sequence caches."""

    def __init__(self, shape: ModelShape, n_seqs: int, max_len: int, device: torch.device | str,
                 dtype: torch.dtype) -> None:
        self.shape = shape
        self.max_len = max_len
        cache_shape = (shape.n_layers, n_seqs, max_len, shape.n_kv_heads, shape.head_dim)
        self.k = torch.zeros(cache_shape, device=device, dtype=dtype)
        self.v = torch.zeros(cache_shape, device=device, dtype=dtype)
        self.lengths = [0] * n_seqs
        self._rows: list[tuple[int, int, int]] = []

    def begin(self, rows: list[tuple[int, int, int]]) -> None:
        """Declare the step: ``(seq, start_pos, count)`` per sequence, in flat token order.

        A sequence's cache is cut to ``start_pos`` (so a rewind or a re-prefill just works); a
        start past what is cached would leave a hole, so it is refused."""
        seen: set[int] = set()
        for seq, start, count in rows:
            if seq in seen:
                raise ValueError(f"sequence {seq} appears twice in one step")
            seen.add(seq)
            if not 0 <= start <= self.lengths[seq]:
                raise ValueError(f"sequence {seq}: start {start} but {self.lengths[seq]} positions cached")
            if count < 1 or start + count > self.max_len:
                raise ValueError(f"sequence {seq}: {count} tokens from {start} exceed max_len {self.max_len}")
        for seq, start, count in rows:
            self.lengths[seq] = start + count
        self._rows = list(rows)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
               window: int | None, scale: float, softcap: float | None) -> torch.Tensor:
        """Store this step's k/v for ``layer`` and return attention for each of its queries."""
        out = torch.empty_like(q)
        offset = 0
        for seq, start, count in self._rows:
            end = start + count
            self.k[layer, seq, start:end] = k[offset:offset + count]
            self.v[layer, seq, start:end] = v[offset:offset + count]
            keys, values = self.k[layer, seq, :end], self.v[layer, seq, :end]
            out[offset:offset + count] = _attend_one(q[offset:offset + count], keys, values, start,
                                                     window=window, scale=scale, softcap=softcap)
            offset += count
        if offset != q.shape[0]:
            raise ValueError(f"begin() declared {offset} tokens but attend got {q.shape[0]}")
        return out


def causal_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """Boolean [Tq, Tk]: key j visible to query i when j <= i and (no window or i - j < window)."""
    diff = q_pos[:, None] - k_pos[None, :]
    mask = diff >= 0
    if window is not None:
        mask &= diff < window
    return mask


def _attend_one(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, *, window: int | None,
                scale: float, softcap: float | None) -> torch.Tensor:
    """q [Tq, H, D] at positions start.., k/v [Tk, Hkv, D] at positions 0..Tk-1 -> [Tq, H, D]."""
    tq, n_heads, _ = q.shape
    n_kv = k.shape[1]
    q_pos = torch.arange(start, start + tq, device=q.device)
    k_pos = torch.arange(k.shape[0], device=q.device)
    mask = causal_mask(q_pos, k_pos, window)
    qh, kh, vh = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)  # heads first
    if softcap is None:
        # An explicit mask: the queries start mid-sequence (decode, chunks) and windows cut the past.
        out = F.scaled_dot_product_attention(qh.unsqueeze(0), kh.unsqueeze(0), vh.unsqueeze(0),
                                             attn_mask=mask, scale=scale, enable_gqa=n_heads != n_kv)
        return out.squeeze(0).transpose(0, 1)
    # Soft-capping sits between the scores and the softmax, where SDPA offers no hook.
    group = n_heads // n_kv
    kh = kh.repeat_interleave(group, dim=0)
    vh = vh.repeat_interleave(group, dim=0)
    scores = torch.matmul(qh, kh.transpose(1, 2)).float() * scale
    scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(vh.dtype)
    return torch.matmul(probs, vh).transpose(0, 1)
