"""Read a model's weights (GGUF file or HF safetensors directory) into basert's internal names.

Both readers work in two passes: first names, shapes and types are checked against what the
ModelShape requires (so a bad file fails in milliseconds, naming the tensor), then the tensors are
read onto the CPU. Nothing touches the device here; ``model.build`` moves the checked set.

The GGUF traps handled (tests/unit/test_basert_model.py checks each: basert, transformers and
llama.cpp reading the same converted file must give the HF model's logits):
- llama.cpp permutes llama's Q/K rows into its interleaved RoPE layout; undone here so one
  rotate-half RoPE serves every architecture.
- numpy already reverses ggml's dimension order, so a dequantized weight is [out, in].
- Gemma's converter folded the HF ``1 + w`` into every norm weight; GGUF norms are multipliers
  as they stand (HF ones get the +1 here instead).
- Llama 3.1's rope scaling arrives as a ``rope_freqs`` tensor of per-frequency divisors.
- Gemma 3's local layers use RoPE base 10 000 and a 5-local:1-global pattern llama.cpp hard-codes.
"""

from __future__ import annotations

import json
import math
import os
import re
from typing import Any, Callable

import attrs
import numpy as np
import torch

from superfluid.core.errors import ConfigError
from superfluid.plugins.gguf_file import GgufFile, Tensor

from .shape import (HF_VLM_HEAD_PREFIX, SUPPORTED_ARCHS, ModelShape, RopeScaling, expected_shapes, hf_text_config,
                    parse_rope_scaling)

# Quantization types read (via gguf.quants.dequantize). Others are refused by name.
GGUF_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
              "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS")

# Internal per-layer name -> (GGUF name, HF name).
_LAYER_NAMES = {
    "attn_norm.weight": ("attn_norm.weight", "input_layernorm.weight"),
    "q.weight": ("attn_q.weight", "self_attn.q_proj.weight"),
    "k.weight": ("attn_k.weight", "self_attn.k_proj.weight"),
    "v.weight": ("attn_v.weight", "self_attn.v_proj.weight"),
    "o.weight": ("attn_output.weight", "self_attn.o_proj.weight"),
    "q.bias": ("attn_q.bias", "self_attn.q_proj.bias"),
    "k.bias": ("attn_k.bias", "self_attn.k_proj.bias"),
    "v.bias": ("attn_v.bias", "self_attn.v_proj.bias"),
    "o.bias": ("attn_output.bias", "self_attn.o_proj.bias"),
    "q_norm.weight": ("attn_q_norm.weight", "self_attn.q_norm.weight"),
    "k_norm.weight": ("attn_k_norm.weight", "self_attn.k_norm.weight"),
    "post_attn_norm.weight": ("post_attention_norm.weight", "post_attention_layernorm.weight"),
    "ffn_norm.weight": ("ffn_norm.weight", "post_attention_layernorm.weight"),  # gemma: see _hf_name
    "post_ffn_norm.weight": ("post_ffw_norm.weight", "post_feedforward_layernorm.weight"),
    "gate.weight": ("ffn_gate.weight", "mlp.gate_proj.weight"),
    "up.weight": ("ffn_up.weight", "mlp.up_proj.weight"),
    "down.weight": ("ffn_down.weight", "mlp.down_proj.weight"),
}
_TOP_NAMES = {
    "embed.weight": ("token_embd.weight", "model.embed_tokens.weight"),
    "norm.weight": ("output_norm.weight", "model.norm.weight"),
    "head.weight": ("output.weight", "lm_head.weight"),
}
_LAYER_KEY = re.compile(r"layers\.(\d+)\.(.+)")


def _gguf_name(key: str, shape: ModelShape) -> str:
    m = _LAYER_KEY.fullmatch(key)
    return f"blk.{m[1]}.{_LAYER_NAMES[m[2]][0]}" if m else _TOP_NAMES[key][0]


def _hf_name(key: str, shape: ModelShape) -> str:
    m = _LAYER_KEY.fullmatch(key)
    if not m:
        return _TOP_NAMES[key][1]
    if shape.sandwich_norm and m[2] == "ffn_norm.weight":
        return f"model.layers.{m[1]}.pre_feedforward_layernorm.weight"
    return f"model.layers.{m[1]}.{_LAYER_NAMES[m[2]][1]}"


def read_weights(path: str, *, name: str, dtype: torch.dtype) -> tuple[ModelShape, dict[str, torch.Tensor]]:
    """(shape, checked CPU tensors by internal name) of a .gguf file or an HF directory."""
    if os.path.isdir(path):
        return _read_hf(path, name, dtype)
    if path.endswith(".gguf") and os.path.isfile(path):
        return _read_gguf(path, name, dtype)
    raise ConfigError(f"model {name!r}: {path} is neither a .gguf file nor a directory with config.json")


def _check(name: str, shape: ModelShape, found: dict[str, tuple[int, ...]],
           source_name: Callable[[str, ModelShape], str]) -> None:
    """Every tensor the shape needs is present with the right dimensions, or ConfigError naming it."""
    for key, want in expected_shapes(shape).items():
        src = source_name(key, shape)
        if src not in found:
            raise ConfigError(f"model {name!r}: tensor {src} is missing ({shape.arch})")
        if tuple(found[src]) != want:
            raise ConfigError(f"model {name!r}: tensor {src} has shape {tuple(found[src])}, "
                              f"{shape.arch} with this config needs {want}")


def _cast(key: str, t: torch.Tensor, shape: ModelShape, dtype: torch.dtype) -> torch.Tensor:
    # Gemma's norms are multiplied in float32 (model.RMSNorm), so they are kept in float32.
    keep_float = shape.norm_plus_one and key.endswith("norm.weight")
    return t.to(torch.float32 if keep_float else dtype).contiguous()


# ---- HF directory ---------------------------------------------------------------------------

def _read_hf(path: str, name: str, dtype: torch.dtype) -> tuple[ModelShape, dict[str, torch.Tensor]]:
    from safetensors import safe_open

    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        raise ConfigError(f"model {name!r}: {path} has no config.json")
    with open(config_path) as f:
        config = json.load(f)
    shape = ModelShape.from_hf_config(config, name=name)
    _, prefix = hf_text_config(config, name)
    if prefix == "model.":
        source_name = _hf_name
    else:  # a vision-language model's language half: model.text_model.* (the head stays lm_head)
        head = HF_VLM_HEAD_PREFIX.get(config.get("model_type"), "lm_head.")

        def source_name(key: str, shape: ModelShape) -> str:
            hf = _hf_name(key, shape)
            if hf.startswith("lm_head."):
                return head + hf[len("lm_head."):]
            return prefix + hf[len("model."):] if hf.startswith("model.") else hf

    index_path = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index_path):
        with open(index_path) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise ConfigError(f"model {name!r}: no .safetensors files in {path}")

    where: dict[str, str] = {}
    found: dict[str, tuple[int, ...]] = {}
    for file in files:
        full = os.path.join(path, file)
        if not os.path.isfile(full):
            raise ConfigError(f"model {name!r}: shard {file} named by the index is missing")
        with safe_open(full, framework="pt") as st:
            for key in st.keys():
                where[key] = full
                found[key] = tuple(st.get_slice(key).get_shape())
    # absent head = tied, whatever the config claims
    tied = HF_VLM_HEAD_PREFIX.get(config.get("model_type"), "lm_head.") + "weight" not in found
    shape = attrs.evolve(shape, tie_embeddings=tied)
    _check(name, shape, found, source_name)

    tensors: dict[str, torch.Tensor] = {}
    by_file: dict[str, list[str]] = {}
    for key in expected_shapes(shape):
        by_file.setdefault(where[source_name(key, shape)], []).append(key)
    for file, keys in by_file.items():
        with safe_open(file, framework="pt") as st:
            for key in keys:
                t = st.get_tensor(source_name(key, shape))
                if shape.norm_plus_one and key.endswith("norm.weight"):
                    t = t.float() + 1.0  # HF Gemma stores w for a multiplier of (1 + w)
                tensors[key] = _cast(key, t, shape, dtype)
    return shape, tensors


# ---- GGUF -----------------------------------------------------------------------------------

def _gguf_shape(meta: dict[str, Any], tensors: dict[str, Tensor], arch: str, name: str) -> ModelShape:
    def get(key: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{key}", default)
        if value is None:
            raise ConfigError(f"model {name!r}: GGUF metadata {arch}.{key} is missing")
        return value

    def per_layer_const(key: str, default: Any = None) -> int:
        value = get(key, default)
        if isinstance(value, list):
            if len(set(value)) != 1:
                raise ConfigError(f"model {name!r}: per-layer {arch}.{key} {value} is not supported")
            value = value[0]
        return int(value)

    hidden = int(get("embedding_length"))
    n_layers = int(get("block_count"))
    n_heads = per_layer_const("attention.head_count")
    n_kv = per_layer_const("attention.head_count_kv", n_heads)
    head_dim = int(meta.get(f"{arch}.attention.key_length") or hidden // n_heads)
    rope_dim = int(meta.get(f"{arch}.rope.dimension_count") or head_dim)
    if rope_dim != head_dim:
        raise ConfigError(f"model {name!r}: partial RoPE ({rope_dim} of {head_dim} dims) is not supported")
    if "token_embd.weight" not in tensors:
        raise ConfigError(f"model {name!r}: tensor token_embd.weight is missing ({arch})")
    vocab = int(tensors["token_embd.weight"].dims[1])  # ggml order: ne = [hidden, vocab]

    scaling_type = meta.get(f"{arch}.rope.scaling.type")
    scaling: RopeScaling | None = None
    if scaling_type not in (None, "none"):
        scaling = parse_rope_scaling({"rope_type": scaling_type,
                                      "factor": meta.get(f"{arch}.rope.scaling.factor")}, name)
    freq_factors = None
    if "rope_freqs.weight" in tensors:
        freq_factors = tuple(float(x) for x in tensors["rope_freqs.weight"].dequantize().reshape(-1))
        if len(freq_factors) != head_dim // 2:
            raise ConfigError(f"model {name!r}: tensor rope_freqs.weight has {len(freq_factors)} "
                              f"entries, head_dim {head_dim} needs {head_dim // 2}")

    gemma = arch == "gemma3"
    windows: tuple[int | None, ...] = (None,) * n_layers
    scale = head_dim ** -0.5
    if gemma and meta.get(f"{arch}.attention.sliding_window"):  # no window key: all layers global
        window = int(meta[f"{arch}.attention.sliding_window"])
        pattern = meta.get(f"{arch}.attention.sliding_window_pattern", 6)
        if isinstance(pattern, list):  # one flag per layer, true = sliding
            windows = tuple(window if bool(p) else None for p in pattern[:n_layers])
        else:  # every pattern-th layer global; 0 = all sliding (llama.cpp's set_swa_pattern)
            pattern = int(pattern)
            windows = tuple(window if pattern == 0 or (i + 1) % pattern else None for i in range(n_layers))
    if gemma and n_layers == 62:  # Gemma 3 27B is trained with query_pre_attn_scalar = hidden / heads
        scale = (hidden // n_heads) ** -0.5
    final_softcap = meta.get(f"{arch}.final_logit_softcapping")
    return ModelShape(
        arch=arch, vocab_size=vocab, hidden_size=hidden, n_layers=n_layers, n_heads=n_heads,
        n_kv_heads=n_kv, head_dim=head_dim, intermediate_size=per_layer_const("feed_forward_length"),
        rms_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(get("rope.freq_base", 1e6 if gemma else 1e4)),
        max_position=int(get("context_length", 4096)),
        tie_embeddings="output.weight" not in tensors,
        windows=windows, attn_scale=scale,
        attn_softcap=None,  # none of the four architectures soft-caps attention scores
        final_softcap=float(final_softcap) if final_softcap else None,
        local_rope_theta=float(meta.get(f"{arch}.rope.freq_base_swa", 10000.0)) if gemma else None,
        rope_scaling=scaling, rope_freq_factors=freq_factors,
        qkv_bias="blk.0.attn_q.bias" in tensors, o_bias="blk.0.attn_output.bias" in tensors,
        qk_norm=arch in ("qwen3", "gemma3"), sandwich_norm=gemma,
        norm_plus_one=gemma, activation="gelu_tanh" if gemma else "silu",
        embed_scale=math.sqrt(hidden) if gemma else 1.0,
    )


def _unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (HF's rotate-half pairs -> interleaved pairs)."""
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _read_gguf(path: str, name: str, dtype: torch.dtype) -> tuple[ModelShape, dict[str, torch.Tensor]]:
    try:  # (GgufFile, not gguf.GGUFReader: the tokenizer's arrays, never needed here, cost seconds there)
        gguf_file = GgufFile(path)
        tensors = gguf_file.tensors
    except (ValueError, OSError) as exc:
        raise ConfigError(f"model {name!r}: {path} is not a readable GGUF file ({exc})") from None
    meta = gguf_file.fields
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise ConfigError(f"model {name!r}: architecture {arch!r} is not supported; "
                          f"supported: {', '.join(SUPPORTED_ARCHS)}")
    shape = _gguf_shape(meta, tensors, arch, name)
    found = {n: t.array_shape for n, t in tensors.items()}
    _check(name, shape, found, _gguf_name)
    needed = {key: _gguf_name(key, shape) for key in expected_shapes(shape)}
    for src in needed.values():
        qtype = tensors[src].tensor_type
        if qtype.name not in GGUF_TYPES:
            raise ConfigError(f"model {name!r}: tensor {src} has quantization type {qtype.name}, "
                              f"which basert does not read (it reads {', '.join(GGUF_TYPES)})")

    out: dict[str, torch.Tensor] = {}
    for key, src in needed.items():
        w = tensors[src].dequantize()
        if arch == "llama" and key.split(".")[-2] in ("q", "k"):
            w = _unpermute(w, shape.n_heads if key.split(".")[-2] == "q" else shape.n_kv_heads)
        w = np.ascontiguousarray(w)
        if not w.flags.writeable:  # an F32 tensor dequantizes to a view of the read-only map
            w = w.copy()
        out[key] = _cast(key, torch.from_numpy(w), shape, dtype)
    return shape, out
