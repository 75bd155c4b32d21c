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
        """Store this step's k/v for ``layer`` and return attention for each of its queries.

        Rows of one token (decodes) go through one batched call, keys padded to the longest and
        masked; longer rows (prefill chunks) one call each. Without the batching a plain decode
        baseline would make one kernel call per sequence per layer."""
        offsets, offset = [], 0
        for seq, start, count in self._rows:
            self.k[layer, seq, start:start + count] = k[offset:offset + count]
            self.v[layer, seq, start:start + count] = v[offset:offset + count]
            offsets.append(offset)
            offset += count
        if offset != q.shape[0]:
            raise ValueError(f"begin() declared {offset} tokens but attend got {q.shape[0]}")
        out = torch.empty_like(q)
        decodes = [i for i, (_, _, count) in enumerate(self._rows) if count == 1]
        if len(decodes) < 2:
            decodes = []
        for i, (seq, start, count) in enumerate(self._rows):
            if i in decodes:
                continue
            at, end = offsets[i], start + count
            qh = q[at:at + count].transpose(0, 1)[None]          # [1, H, count, D]
            kh = self.k[layer, seq, :end].transpose(0, 1)[None]  # [1, Hkv, end, D]
            vh = self.v[layer, seq, :end].transpose(0, 1)[None]
            q_pos = torch.arange(start, end, device=q.device)
            mask = causal_mask(q_pos, torch.arange(end, device=q.device), window)[None, None]
            out[at:at + count] = _attention(qh, kh, vh, mask, scale, softcap)[0].transpose(0, 1)
        if decodes:
            at = torch.tensor([offsets[i] for i in decodes], device=q.device)
            seqs = torch.tensor([self._rows[i][0] for i in decodes], device=q.device)
            q_pos = torch.tensor([self._rows[i][1] for i in decodes], device=q.device)
            longest = int(max(self._rows[i][1] for i in decodes)) + 1
            kh = self.k[layer, seqs, :longest].transpose(1, 2)    # [B, Hkv, longest, D]
            vh = self.v[layer, seqs, :longest].transpose(1, 2)
            mask = causal_mask(q_pos, torch.arange(longest, device=q.device), window)[:, None, None, :]
            out[at] = _attention(q[at][:, :, None, :], kh, vh, mask, scale, softcap)[:, :, 0, :]
        return out


def causal_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """Boolean [Tq, Tk]: key j visible to query i when j <= i and (no window or i - j < window)."""
    diff = q_pos[:, None] - k_pos[None, :]
    mask = diff >= 0
    if window is not None:
        mask &= diff < window
    return mask


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
               softcap: float | None) -> torch.Tensor:
    """q [B, H, Tq, D], k/v [B, Hkv, Tk, D], boolean mask broadcastable to [B, 1, Tq, Tk]."""
    n_heads, n_kv = q.shape[1], k.shape[1]
    if softcap is None:
        # An explicit mask: queries start mid-sequence (decode, chunks) and windows cut the past.
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=n_heads != n_kv)
    # Soft-capping sits between the scores and the softmax, where SDPA offers no hook.
    k = k.repeat_interleave(n_heads // n_kv, dim=1)
    v = v.repeat_interleave(n_heads // n_kv, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * scale
    scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1).to(v.dtype), v)
