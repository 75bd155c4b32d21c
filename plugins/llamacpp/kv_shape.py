"""A loaded llama.cpp model's KV shape, from the metadata llama.cpp itself read.

``llama_model_meta_val_str`` gives each GGUF key as text (arrays as ``[a, b, ...]``), so the
shape comes from the very keys llama.cpp sized its tensors from, with no second read of the file.
The computation is :func:`superfluid.plugins.kvpool.shape.from_gguf`'s (MLX's GGUF path uses it
too)."""

from __future__ import annotations

import ctypes

from superfluid.plugins.kvpool.shape import KVShape, from_gguf, parse_meta_value

# the context's default cache types: llama_context_default_params' (--kv-bits sets others: context_params.py)
CACHE_TYPE_K = "f16"
CACHE_TYPE_V = "f16"


def meta_getter(model):
    """``get(key)`` over a loaded model's metadata (None for a key it lacks)."""
    import llama_cpp

    def get(key: str):
        buf = ctypes.create_string_buffer(4096)
        n = llama_cpp.llama_model_meta_val_str(model, key.encode(), buf, len(buf))
        if n < 0:
            return None
        if n >= len(buf):  # a long array (per-layer values of a deep model)
            buf = ctypes.create_string_buffer(n + 1)
            llama_cpp.llama_model_meta_val_str(model, key.encode(), buf, len(buf))
        return parse_meta_value(buf.value.decode("utf-8", errors="replace"))

    return get


def model_kv_shape(model, type_k: str = CACHE_TYPE_K, type_v: str = CACHE_TYPE_V) -> KVShape:
    """The model's KV shape at the context's cache types (``q8_0`` / ``q4_0`` under --kv-bits)."""
    return from_gguf(meta_getter(model), type_k, type_v)
