"""What one KV cell (one token's keys and values, every layer) of a model costs, from the model's
declared shape rather than from its embedding width.

A layer's K row is ``key_length × n_head_kv`` elements and its V row ``value_length × n_head_kv``.
Many models do not have ``key_length = n_embd / n_head``: Qwen3 declares head_dim 128 beside a
2560-wide embedding and 32 heads (80), Gemma 3 270M 256 beside 640 / 4 (160). GGUF states them as
``<arch>.attention.key_length`` / ``.value_length`` (``_swa`` variants for the sliding-window
layers of some architectures); ``head_count_kv`` may be an array, one value a layer, with 0 for a
layer without attention (the recurrent layers of hybrid models).

:meth:`KVShape.allocated_bytes` mirrors how llama.cpp (the pinned 0.3.36 build) allocates a context's
KV: one K and one V tensor per layer of ``cells × streams`` rows (one stream per sequence, or one
for a unified pool). A model with a sliding window gets two caches (``llama_kv_cache_iswa``): its
full-attention layers hold every cell, and its window layers hold every cell too when
``swa_full`` is set (``llama_context_default_params``' default, which the worker keeps, so a
cut-back prefix keeps the cells its next token attends to), else only
``pad256(min(cells, n_swa × (unified ? sequences : 1) + n_ubatch))`` cells a stream. With
flash attention off, V is stored transposed and every layer's V row is padded to the widest.

Which layers slide is llama.cpp's per-architecture choice (``load_swa_pattern``): a GGUF may
state it (``attention.sliding_window_pattern``, an array of booleans or a period), else
:data:`SWA_PATTERNS` holds the periods llama.cpp uses. It matters only when ``swa_full`` is off
or the window layers have their own head sizes. Not modelled: multi-head latent attention (MLA,
DeepSeek 2/3), whose cache is its compressed latent, and a recurrent model's state, which is not
per cell. The llama.cpp worker checks its figure against the sizes llama.cpp logs.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import attrs

# element sizes as (bytes, elements) a block, ggml's ggml_type_size / ggml_blck_size
CACHE_TYPES: dict[str, tuple[int, int]] = {
    "f32": (4, 1), "f16": (2, 1), "bf16": (2, 1),
    "q8_0": (34, 32), "q4_0": (18, 32), "q4_1": (20, 32), "q5_0": (22, 32), "q5_1": (24, 32),
    "iq4_nl": (18, 32),
}

# llama.cpp 0.3.36's sliding-window periods per architecture (src/models/*.cpp load_swa_pattern:
# (period, dense_first)); a GGUF's own attention.sliding_window_pattern overrides them
SWA_PATTERNS: dict[str, tuple[int, bool]] = {
    "gemma2": (2, False), "gemma3": (6, False), "gemma-embedding": (6, False), "gemma3n": (5, False),
    "cohere2": (4, False), "cohere2moe": (4, True), "llama4": (4, False), "exaone4": (4, False),
    "exaone-moe": (4, False), "olmo2": (4, False), "gpt-oss": (2, False), "smallthinker": (4, True),
    "afmoe": (4, False), "plamo3": (8, False),
}


def row_bytes(cache_type: str, n: int) -> int:
    """Bytes of ``n`` elements of a cache type (ggml_row_size)."""
    size, block = CACHE_TYPES[cache_type]
    return size * n // block


def swa_layers(n_layer: int, period: int, dense_first: bool = False) -> tuple[bool, ...]:
    """llama.cpp's ``set_swa_pattern``: which of ``n_layer`` layers use the window (period 0:
    all of them; else one full layer every ``period``, last of each group or first)."""
    if period == 0:
        return (True,) * n_layer
    if dense_first:
        return tuple(il % period != 0 for il in range(n_layer))
    return tuple(il % period < period - 1 for il in range(n_layer))


def pad(n: int, to: int) -> int:
    return (n + to - 1) // to * to


@attrs.frozen
class KVShape:
    """Per layer: K and V row widths in elements (head length × KV heads; 0: the layer holds no
    KV) and whether it uses the sliding window; the window; the cache types."""

    k_width: tuple[int, ...]
    v_width: tuple[int, ...]
    swa: tuple[bool, ...]
    n_swa: int = 0
    type_k: str = "f16"
    type_v: str = "f16"

    @property
    def n_layer(self) -> int:
        return len(self.k_width)

    def layer_bytes(self, il: int, v_trans: bool = False) -> int:
        """K + V bytes one cell takes on layer ``il`` (``v_trans``: V padded to the widest layer)."""
        v = max(self.v_width) if v_trans and self.k_width[il] else self.v_width[il]
        return row_bytes(self.type_k, self.k_width[il]) + row_bytes(self.type_v, v)

    def bytes_per_cell(self, v_trans: bool = False, window: bool | None = None) -> int:
        """K + V bytes of one cell over the layers (``window`` True / False: only the sliding or
        only the full-attention ones; None: all)."""
        return sum(self.layer_bytes(il, v_trans) for il in range(self.n_layer)
                   if self.k_width[il] and (window is None or self.swa[il] == window))

    @property
    def sliding(self) -> bool:
        return self.n_swa > 0 and any(self.swa)

    def window_cells(self, n_ctx: int, n_seq: int, unified: bool, swa_full: bool, n_ubatch: int) -> int:
        """Cells a stream of the window layers' cache holds (llama_kv_cache_iswa)."""
        per_stream = n_ctx if unified else n_ctx // n_seq
        if swa_full:
            return per_stream
        return pad(min(per_stream, self.n_swa * (n_seq if unified else 1) + n_ubatch), 256)

    def allocated_bytes(self, n_ctx: int, n_seq: int, unified: bool, *, swa_full: bool = True,
                        n_ubatch: int = 512, v_trans: bool = False) -> int:
        """The KV bytes llama.cpp allocates for a context of ``n_ctx`` cells (llama_n_ctx, after its
        padding) and ``n_seq`` sequences."""
        if not self.sliding:
            return n_ctx * self.bytes_per_cell(v_trans)
        streams = 1 if unified else n_seq
        full = n_ctx * self.bytes_per_cell(v_trans, window=False)
        window = streams * self.window_cells(n_ctx, n_seq, unified, swa_full, n_ubatch)
        return full + window * self.bytes_per_cell(v_trans, window=True)

    def cells_within(self, budget: int, n_seq: int, *, swa_full: bool = True, n_ubatch: int = 512,
                     v_trans: bool = False) -> int:
        """The most cells of a unified pool whose KV fits ``budget`` bytes."""
        marginal = self.bytes_per_cell(v_trans) if swa_full or not self.sliding else \
            self.bytes_per_cell(v_trans, window=False)
        if marginal <= 0:
            return 0
        fixed = 0 if swa_full or not self.sliding else \
            pad(self.n_swa * n_seq + n_ubatch, 256) * self.bytes_per_cell(v_trans, window=True)
        return max(0, budget - fixed) // marginal

    def describe(self) -> dict:
        return {"layers": self.n_layer, "bytes_per_cell": self.bytes_per_cell(), "type_k": self.type_k,
                "type_v": self.type_v, "n_swa": self.n_swa, "window_layers": sum(self.swa) if self.n_swa else 0}


def _per_layer(value, n_layer: int, default: int) -> list[int]:
    if value is None:
        return [default] * n_layer
    if isinstance(value, (list, tuple)):
        values = [int(v) for v in value]
        return (values + [values[-1] if values else default] * n_layer)[:n_layer]
    return [int(value)] * n_layer


def from_gguf(get: Callable[[str], Any], type_k: str = "f16", type_v: str = "f16") -> KVShape:
    """The KV shape a GGUF's metadata declares; ``get(key)`` returns a key's value (an int, a
    bool, a list of them) or None. Defaults are llama.cpp's (llama_model::load_hparams)."""
    arch = str(get("general.architecture") or "")

    def g(key: str):
        return get(f"{arch}.{key}")

    n_layer = int(g("block_count") or 0)
    heads = _per_layer(g("attention.head_count"), n_layer, 0)
    kv_heads = _per_layer(g("attention.head_count_kv"), n_layer, 0) if g("attention.head_count_kv") is not None \
        else heads
    n_head = heads[0] if heads else 0
    n_embd = int(g("embedding_length") or 0)
    k_len = int(g("attention.key_length") or (n_embd // n_head if n_head else 0))
    v_len = int(g("attention.value_length") or (n_embd // n_head if n_head else 0))
    k_swa = int(g("attention.key_length_swa") or k_len)
    v_swa = int(g("attention.value_length_swa") or v_len)
    n_swa = int(g("attention.sliding_window") or 0)
    swa = (False,) * n_layer
    if n_swa:
        pattern = g("attention.sliding_window_pattern")
        if isinstance(pattern, (list, tuple)):
            swa = tuple(bool(p) for p in pattern)[:n_layer]
            swa += (False,) * (n_layer - len(swa))
        elif pattern is not None:
            swa = swa_layers(n_layer, int(pattern), SWA_PATTERNS.get(arch, (0, False))[1])
        elif arch in SWA_PATTERNS:
            swa = swa_layers(n_layer, *SWA_PATTERNS[arch])
        # else: an architecture this table does not know: every layer counted full-size (an
        # over-estimate only where swa_full is off)
    k = tuple((k_swa if swa[il] else k_len) * kv_heads[il] for il in range(n_layer))
    v = tuple((v_swa if swa[il] else v_len) * kv_heads[il] for il in range(n_layer))
    return KVShape(k, v, swa, n_swa if any(swa) else 0, type_k, type_v)


def parse_meta_value(text: str | None):
    """A value of ``llama_model_meta_val_str`` (llama.cpp's gguf_kv_to_str) as Python: ``"[1, 0]"``
    a list, ``"true"`` a bool, numbers as numbers, anything else the string."""
    if text is None:
        return None
    text = text.strip()
    if text.startswith("[") and text.endswith("]"):
        inner = text[1:-1].strip()
        return [parse_meta_value(part) for part in inner.split(",")] if inner else []
    if text in ("true", "false"):
        return text == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def gguf_file_getter(path: str) -> Callable[[str], Any]:
    """``get`` for :func:`from_gguf` over a GGUF file's metadata (:class:`GgufFile`: its header
    alone, the vocabulary's strings left undecoded)."""
    from superfluid.plugins.gguf_file import GgufFile

    return GgufFile(path).get


def mapping_getter(meta: Mapping[str, Any]) -> Callable[[str], Any]:
    """``get`` over a metadata dict (MLX's ``mx.load(..., return_metadata=True)``: arrays as
    ``mx.array``)."""
    def get(key: str):
        value = meta.get(key)
        if value is None or isinstance(value, (str, int, float, bool, list, tuple)):
            return value
        return value.tolist() if hasattr(value, "tolist") else value

    return get
