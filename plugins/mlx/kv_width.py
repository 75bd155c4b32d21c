"""--kv-bits on the MLX engine, decided in the daemon (no MLX import): the width asked for, and a
ConfigError where the model cannot hold a quantized KV.

mlx-lm's ``QuantizedKVCache`` quantizes each head's row of keys and values in groups of
:data:`GROUP_SIZE` (``mx.quantize`` refuses a row that is not a whole number of groups), so a
model whose heads are not a multiple of 64 long (the tiny test models' 16, Gemma 3 270M's 256 is
fine) is refused at startup, naming the engine and the head length. The worker then runs one
token through the loaded model with quantized caches before it reports ready (``kv_cells.probe``),
so an attention that cannot read them fails the load with the engine's reason instead of the
first request."""

from __future__ import annotations

import json
import os

from superfluid.core.config import CORE_OPTIONS
from superfluid.core.errors import ConfigError

GROUP_SIZE = 64  # mlx-lm's kv_group_size default, the one its generate uses


def head_lengths(path: str) -> list[int]:
    """The head lengths of keys and values a model file declares (empty: it does not say)."""
    if os.path.isdir(path):
        with open(os.path.join(path, "config.json")) as fh:
            config = json.load(fh)
        text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
        heads = int(text.get("num_attention_heads") or 0)
        head = int(text.get("head_dim") or (int(text.get("hidden_size") or 0) // heads if heads else 0))
        return [head] if head else []
    from superfluid.plugins.kvpool.shape import gguf_file_getter

    get = gguf_file_getter(path)
    arch = str(get("general.architecture") or "")
    heads = get(f"{arch}.attention.head_count")
    heads = int(heads[0] if isinstance(heads, (list, tuple)) else heads or 0)
    n_embd = int(get(f"{arch}.embedding_length") or 0)
    default = n_embd // heads if heads else 0
    dims = [int(get(f"{arch}.attention.key_length") or default), int(get(f"{arch}.attention.value_length") or default)]
    return [d for d in dims if d]


def kv_bits(model, path: str) -> int:
    """The model's --kv-bits (0: full width), or a ConfigError naming the engine and why the model
    cannot take it (:func:`check`)."""
    bits = int(CORE_OPTIONS.of(model).kv_bits or 0)
    if bits:
        check(model.name, path, bits)
    return bits


def check(name: str, path: str, bits: int) -> None:
    """ConfigError where the model at ``path`` cannot hold a ``bits``-bit KV."""
    try:
        odd = sorted({d for d in head_lengths(path) if d % GROUP_SIZE})
    except (OSError, ValueError) as exc:
        raise ConfigError(f"model {name!r}: engine 'mlx' cannot read the head length for --kv-bits "
                          f"{bits}: {exc}") from None
    if odd:
        raise ConfigError(f"model {name!r}: engine 'mlx' cannot serve --kv-bits {bits}: mlx-lm's quantized "
                          f"KV cache quantizes each head's keys and values in groups of {GROUP_SIZE}, and this "
                          f"model's heads are {odd[0]} long; leave --kv-bits out (or 0) for it")
