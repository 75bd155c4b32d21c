"""One layer's caches seen as one cache by a batched single-token step over several slots."""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import KVCache


class LaneBatchView:
    """One layer's cache for a batched single-token step over several slots.

    mlx-lm's attention asks the cache for ``offset`` (RoPE positions, one per row here), calls
    ``update_and_fetch`` with the step's keys and values, and layer 0's cache for the mask.
    Each row is appended to its own slot's ``KVCache``; the rows' keys and values are then
    left-padded to the longest and stacked, and the mask hides the padding. A sliding-window
    layer's mask (``window_size``, Gemma 3's local layers) also hides what lies beyond the window:
    every row's query is the last column, so a key ``window_size`` columns or more before it is
    out of every row's window alike.

    Quantized caches (--kv-bits, ``QuantizedKVCache``) give each of keys and values as a triple
    (packed ints, scales, biases): each part is padded and stacked alike (zero padding
    dequantizes to zeros, and is masked anyway), and the view carries the caches' ``bits`` and
    ``group_size``, by which mlx-lm's attention knows to read the triples."""

    def __init__(self, caches: list[KVCache], pads: list[int], mask: mx.array):
        self.caches = caches
        self.pads = pads
        self.offset = mx.array([c.offset for c in caches])
        self.mask = mask
        if hasattr(caches[0], "bits"):  # mlx-lm's scaled_dot_product_attention asks hasattr(cache, "bits")
            self.bits, self.group_size = caches[0].bits, caches[0].group_size

    def update_and_fetch(self, keys, values):
        ks, vs = [], []
        for i, cache in enumerate(self.caches):
            k, v = cache.update_and_fetch(keys[i:i + 1], values[i:i + 1])
            ks.append(_left_pad(k, self.pads[i]))
            vs.append(_left_pad(v, self.pads[i]))
        return _stack(ks), _stack(vs)

    def make_mask(self, n: int, return_array: bool = False, window_size=None):
        longest = self.mask.shape[-1]
        if window_size is None or window_size >= longest:
            return self.mask
        return self.mask & (mx.arange(longest) >= longest - window_size).reshape(1, 1, 1, longest)


def _left_pad(x, pad: int):
    """``pad`` empty cells before a row's cells (each part of a quantized triple alike)."""
    if not pad:
        return x
    if isinstance(x, tuple):
        return tuple(_left_pad(part, pad) for part in x)
    return mx.pad(x, [(0, 0), (0, 0), (pad, 0), (0, 0)])


def _stack(rows: list):
    if isinstance(rows[0], tuple):
        return tuple(mx.concatenate(parts, axis=0) for parts in zip(*rows))
    return mx.concatenate(rows, axis=0)


def batch_views(slot_caches: list[list[KVCache]]) -> list[LaneBatchView]:
    """A view per layer over the slots' caches, for one single-token step."""
    lengths = [caches[0].offset + 1 for caches in slot_caches]
    longest = max(lengths)
    pads = [longest - n for n in lengths]
    mask = (mx.arange(longest)[None, :] >= mx.array(pads)[:, None]).reshape(len(pads), 1, 1, longest)
    n_layers = len(slot_caches[0])
    return [LaneBatchView([caches[layer] for caches in slot_caches], pads, mask) for layer in range(n_layers)]
