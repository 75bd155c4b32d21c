"""The MLX KV pool, sized as the llama.cpp adapter sizes its own (``superfluid.plugins.kvpool``).

MLX grows each slot's caches as they fill (mlx-lm's ``KVCache``, 256 cells at a time), so the
"pool" is a budget of cells, the capacity the scheduler's pressure ladder measures occupancy
against, and for a shared pool a bound the runner keeps (a step that would take the slots past it
is refused as llama.cpp's full pool refuses it, ``PoolFull``, and the scheduler frees room):

* plain attention: lanes + 2 slots (4..256) of max-context cells each, the two beyond the lanes
  spare slots where the most recently finished conversations wait (``spare_slots``), uncapped as
  llama.cpp's per-sequence buffers are;
* sliding-window models (mlx-lm gives some layers a ``RotatingKVCache``: Gemma 2 and 3, ...), or
  any with --kv-unified: one pool of lanes × max-context cells (--kv-pool-cells if set) capped at
  60 % of the memory the weights leave free, never below one lane's context.

Bytes per cell come from the loaded model: each layer's K and V widths are its ``k_proj`` and
``v_proj`` output widths (KV heads × head length, the rows its cache stores), the element size the
dtype the model computes in. The runner gives every layer a plain ``KVCache`` (its slots are cut,
copied and parked by position), so a window layer stores every cell too: every layer counts.
With --kv-bits the cache is mlx-lm's ``QuantizedKVCache`` (``kv_cells``): a row of ``w`` elements
takes ``w × bits / 8`` bytes of packed ints plus a scale and a bias in the model's dtype for each
group of 64 (8 bits in f16: 68 bytes for 64 elements where f16 takes 128; 4 bits: 36), and the
pool's cells, the shared pool's cap, /health's ``kv_pool`` and the parked bytes count those.

Free memory: on a Mac, Metal's recommended working set less what MLX holds after loading the
weights (``mx.device_info()``); elsewhere (Linux, the CPU device) the host's available memory.
"""

from __future__ import annotations

import attrs

from superfluid.plugins.kvpool.layout import FreeMemory, PoolLayout, decide, host_free
from superfluid.plugins.kvpool.shape import KVShape

CACHE_TYPES = {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}  # mx dtype -> kvpool.shape's name
SCALE_BYTES = {"f32": 4, "f16": 2, "bf16": 2}
GROUP_SIZE = 64  # kv_cells.GROUP_SIZE (not imported: this module is read without MLX's cache classes)


@attrs.frozen
class QuantizedShape(KVShape):
    """A model's KV shape held in mlx-lm's ``QuantizedKVCache``: ``bits`` a element, and a scale
    and a bias of ``scale_bytes`` each per group of :data:`GROUP_SIZE` elements."""

    bits: int = 8
    scale_bytes: int = 2

    def row(self, width: int) -> int:
        return width * self.bits // 8 + width // GROUP_SIZE * 2 * self.scale_bytes

    def layer_bytes(self, il: int, v_trans: bool = False) -> int:
        return self.row(self.k_width[il]) + self.row(self.v_width[il])

    def describe(self) -> dict:
        return {**super().describe(), "kv_bits": self.bits, "group_size": GROUP_SIZE}


def _width(module, fallback: int) -> int:
    """A projection's output width (a quantized layer's weight keeps its output rows too)."""
    weight = getattr(module, "weight", None)
    return int(weight.shape[0]) if weight is not None else fallback


def model_shape(model, cache_type: str = "f16", bits: int = 0) -> KVShape:
    """Per-layer K/V widths of a loaded mlx-lm model; which layers slide, from its own caches;
    ``bits``: its caches quantized (--kv-bits)."""
    args = getattr(model, "args", None)
    heads = int(getattr(args, "num_attention_heads", 0) or 0)
    kv_heads = int(getattr(args, "num_key_value_heads", 0) or heads)
    head_dim = int(getattr(args, "head_dim", 0) or (getattr(args, "hidden_size", 0) // heads if heads else 0))
    k, v = [], []
    for layer in model.layers:
        attn = getattr(layer, "self_attn", None) or getattr(layer, "attention", None)
        k.append(_width(getattr(attn, "k_proj", None), kv_heads * head_dim))
        v.append(_width(getattr(attn, "v_proj", None), kv_heads * head_dim))
    swa, n_swa = window_layers(model, len(k))
    if bits:
        name = f"q{bits}_g{GROUP_SIZE}"
        return QuantizedShape(tuple(k), tuple(v), swa, n_swa, name, name, bits, SCALE_BYTES.get(cache_type, 4))
    return KVShape(tuple(k), tuple(v), swa, n_swa, cache_type, cache_type)


def head_dims(model) -> list[int]:
    """Each attention layer's head length (keys and values), as its cache's rows are cut."""
    args = getattr(model, "args", None)
    heads = int(getattr(args, "num_attention_heads", 0) or 0)
    dims = []
    for layer in model.layers:
        attn = getattr(layer, "self_attn", None) or getattr(layer, "attention", None)
        dim = getattr(attn, "head_dim", None) or int(getattr(args, "head_dim", 0) or 0) or \
            (getattr(args, "hidden_size", 0) // heads if heads else 0)
        dims.append(int(dim))
        v_dim = getattr(attn, "v_head_dim", None)
        if v_dim:
            dims.append(int(v_dim))
    return dims


def window_layers(model, n_layer: int) -> tuple[tuple[bool, ...], int]:
    """(which layers slide, the window) as mlx-lm's ``make_cache`` would build them: a layer with
    a ``RotatingKVCache`` uses a window of its ``max_size``."""
    make = getattr(model, "make_cache", None)
    if make is None:
        return (False,) * n_layer, 0
    from mlx_lm.models.cache import RotatingKVCache

    caches = make()
    swa = tuple(isinstance(c, RotatingKVCache) for c in caches)[:n_layer]
    windows = [c.max_size for c in caches if isinstance(c, RotatingKVCache)]
    return swa + (False,) * (n_layer - len(swa)), (max(windows) if windows else 0)


def device_free() -> FreeMemory:
    """Memory the weights leave free where MLX runs (see the module docstring)."""
    import mlx.core as mx

    metal = getattr(mx, "metal", None)
    if metal is not None and metal.is_available():
        info = mx.device_info() if hasattr(mx, "device_info") else metal.device_info()
        limit = int(info.get("max_recommended_working_set_size", 0))
        active = mx.get_active_memory() if hasattr(mx, "get_active_memory") else metal.get_active_memory()
        if limit:
            return FreeMemory(max(0, limit - int(active)), "Metal",
                              "recommended working set less MLX's active memory after loading")
    return host_free()


def layout(shape: KVShape, n_lanes: int, max_context: int, memory: FreeMemory, *, unified: bool = False,
           pool_cells: int = 0, fraction: float = 0.6) -> PoolLayout:
    """The pool for a model of ``shape``: shared for a sliding-window model or when asked."""
    return decide(n_lanes, max_context, shape.sliding or unified, shape.bytes_per_cell(), memory, fraction,
                  pool_cells)


def cache_type(model) -> str:
    """The element type the model's caches will hold: what one token's keys come out as (a GGUF's
    f16 or quantized weights with f32 norms compute, and cache, in f32, not in the dtype its
    token embeddings come out in); that dtype where the model cannot be run so."""
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    try:
        caches = [KVCache() for _ in model.layers]
        model(mx.array([[0]]), cache=caches)
        dtype = caches[0].keys.dtype
    except Exception:  # noqa: BLE001  a model that needs more than tokens: its embeddings' dtype
        try:
            dtype = model.model.embed_tokens(mx.array([0])).dtype
        except (AttributeError, TypeError, ValueError):  # no embed_tokens where it is looked for
            return "f16"
    return CACHE_TYPES.get(str(dtype).rsplit(".", 1)[-1], "f32")
