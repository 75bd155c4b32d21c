"""A slot's per-layer caches, full width or quantized (--kv-bits), and their host copies.

With ``--kv-bits 8|4`` every layer's cache is mlx-lm's ``QuantizedKVCache`` (groups of
:data:`GROUP_SIZE` along the head, each group's packed ints plus a scale and a bias in the
model's dtype), from a slot's first token on: the cache stores each token's keys and values
quantized as they come, and mlx-lm's attention reads the packed triples
(``quantized_scaled_dot_product_attention``). Since a group is one token's row of one head,
a token's stored KV does not depend on how its prompt was cut into passes, so a prompt fed in
one pass or token by token attends over the same quantized cells (what mlx-lm's ``generate``
computes with a prompt cache of ``QuantizedKVCache``).

A full-width cache holds ``keys`` / ``values`` arrays; a quantized one holds a triple of them
each. The runner sees a layer's cache through :func:`arrays` (its arrays, flat) and builds one
from them with :func:`from_arrays`: slicing, parking and park files handle both alike.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache, QuantizedKVCache

GROUP_SIZE = 64  # mlx-lm's kv_group_size default; also the head length a quantized cache needs


def new_cache(bits: int):
    """An empty cache for one layer: full width (``bits`` 0) or quantized to ``bits``."""
    return QuantizedKVCache(group_size=GROUP_SIZE, bits=bits) if bits else KVCache()


def arrays(cache, n: int | None = None) -> list[mx.array]:
    """The cache's arrays (keys then values; a quantized cache's three each), the first ``n``
    cells of them when ``n`` is given; empty for an empty cache."""
    if cache.keys is None:
        return []
    parts = list(cache.keys) + list(cache.values) if isinstance(cache.keys, tuple) else [cache.keys, cache.values]
    return parts if n is None else [a[..., :n, :] for a in parts]


def from_arrays(bits: int, parts: list[mx.array], n: int):
    """A layer's cache holding ``parts`` (as :func:`arrays` gives them) with ``n`` cells used."""
    cache = new_cache(bits)
    if not n:
        return cache
    if bits:
        if len(parts) != 6:
            raise ValueError(f"a {bits}-bit KV cache has 6 arrays a layer, not {len(parts)}")
        cache.state = (tuple(parts[:3]), tuple(parts[3:]), n, GROUP_SIZE, bits)
    else:
        if len(parts) != 2:
            raise ValueError(f"a full-width KV cache has 2 arrays a layer, not {len(parts)}")
        cache.state = (parts[0], parts[1], n)
    return cache


def to_host(a: mx.array) -> tuple[np.ndarray, bool]:
    """A numpy copy; numpy has no bfloat16, so such an array keeps its bits as uint16 (True)."""
    if a.dtype == mx.bfloat16:
        return np.array(a.view(mx.uint16)), True
    return np.array(a), False


def from_host(a: np.ndarray, bf16: bool) -> mx.array:
    arr = mx.array(a)
    return arr.view(mx.bfloat16) if bf16 else arr


def probe(model, bits: int) -> str | None:
    """Why the model cannot run on ``bits``-bit caches (None: it can): one token through it, as
    the worker checks before it reports ready (an attention that reads the cache's arrays
    itself, or a head that is not whole groups, fails here instead of on a request)."""
    if not bits:
        return None
    try:
        caches = [new_cache(bits) for _ in model.layers]
        mx.eval(model(mx.array([[0]]), cache=caches))
    except Exception as exc:  # noqa: BLE001  the reason goes to the daemon's ConfigError-like failure
        return (f"engine 'mlx' cannot serve --kv-bits {bits} for this model: its attention failed on mlx-lm's "
                f"quantized KV cache ({type(exc).__name__}: {exc})")
    return None
