"""Build an mlx-lm model from a model directory or straight from a llama-family GGUF.

GGUF: ``mx.load`` reads Q4_0 / Q4_1 / Q8_0 tensors as MLX quantized triples (packed weight,
scales, biases; groups of 32) and F16/F32 tensors as plain arrays; other quant types (the
k-quants) it cannot read. The tensors are renamed to mlx-lm's llama module paths, the Linear /
Embedding modules whose GGUF tensor is quantized are swapped for their quantized versions with
the bit width the file uses, and mlx-lm's own ``llama.Model`` runs them.

llama.cpp's converter permutes the rows of ``attn_q`` / ``attn_k`` so that rotary embedding
rotates adjacent pairs (GGML's "normal" RoPE) instead of the two halves of a head (Hugging
Face's layout). Rather than permuting the packed quantized rows back, the model is built with
``rope_traditional=True``: MLX's traditional RoPE rotates adjacent pairs, exactly as llama.cpp
does on the same file."""

from __future__ import annotations

import os
import re

GGUF_ARCHS = {"llama"}  # the llama block layout (SmolLM2, Llama 2/3, Mistral without SWA, ...)

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLK = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|scales|biases|bias)$")
_TOP = re.compile(r"^(\w+)\.(weight|scales|biases|bias)$")
GROUP_SIZE = 32  # GGUF's Q4_0 / Q4_1 / Q8_0 block


class ModelLoadError(Exception):
    pass


def _scalar(meta: dict, key: str, default=None):
    value = meta.get(key)
    if value is None:
        return default
    if hasattr(value, "item"):
        return value.item()
    return value


def gguf_architecture(meta: dict) -> str:
    arch = meta.get("general.architecture")
    return str(arch) if arch is not None else ""


def gguf_model_args(meta: dict, weights: dict) -> dict:
    """mlx-lm ``llama.ModelArgs`` keywords from GGUF metadata."""
    arch = gguf_architecture(meta)
    if arch not in GGUF_ARCHS:
        raise ModelLoadError(f"the MLX engine reads GGUF models of architecture {sorted(GGUF_ARCHS)}, "
                             f"not {arch!r}; convert it to an mlx-lm directory instead")
    g = lambda key, default=None: _scalar(meta, f"{arch}.{key}", default)  # noqa: E731
    n_embd = int(g("embedding_length"))
    n_head = int(g("attention.head_count"))
    if g("rope.scaling.type") not in (None, "none"):
        raise ModelLoadError(f"GGUF rope scaling {g('rope.scaling.type')!r} is not supported by the MLX engine")
    if g("attention.sliding_window") is not None:
        raise ModelLoadError("sliding-window GGUF models are not supported by the MLX engine")
    embd = weights["token_embd.weight"]
    n_vocab = int(g("vocab_size", 0)) or embd.shape[0]
    head_dim = int(g("attention.key_length", 0) or g("rope.dimension_count", 0) or n_embd // n_head)
    return dict(
        model_type="llama",
        hidden_size=n_embd,
        num_hidden_layers=int(g("block_count")),
        intermediate_size=int(g("feed_forward_length")),
        num_attention_heads=n_head,
        num_key_value_heads=int(g("attention.head_count_kv", n_head)),
        rms_norm_eps=float(g("attention.layer_norm_rms_epsilon", 1e-5)),
        vocab_size=n_vocab,
        head_dim=head_dim,
        max_position_embeddings=int(g("context_length", 0)) or None,
        rope_theta=float(g("rope.freq_base", 10000.0)),
        rope_traditional=True,  # GGUF's permuted Q/K rows: rotate adjacent pairs, as llama.cpp does
        tie_word_embeddings="output.weight" not in weights,
        attention_bias="blk.0.attn_q.bias" in weights,
        mlp_bias="blk.0.ffn_up.bias" in weights,
    )


def rename_gguf(weights: dict) -> dict:
    out = {}
    for name, value in weights.items():
        m = _BLK.match(name)
        if m:
            layer, part, kind = m.groups()
            if part not in _LAYER_NAMES:
                raise ModelLoadError(f"unexpected GGUF tensor {name!r}")
            out[f"model.layers.{layer}.{_LAYER_NAMES[part]}.{kind}"] = value
            continue
        m = _TOP.match(name)
        if m and m.group(1) in _TOP_NAMES:
            out[f"{_TOP_NAMES[m.group(1)]}.{m.group(2)}"] = value
            continue
        if name.startswith("rope_freqs"):
            raise ModelLoadError("GGUF rope frequency factors (Llama 3.1 rope scaling) are not supported")
        raise ModelLoadError(f"unexpected GGUF tensor {name!r}")
    return out


def load_gguf(path: str, rope: dict | None = None):
    """(model, metadata) for a llama-family GGUF whose tensors are F32/F16/Q4_0/Q4_1/Q8_0; ``rope``:
    model-argument fields laid over the file's (rope_config.overrides)."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx_lm.models import llama

    try:
        raw, meta = mx.load(path, return_metadata=True)
    except Exception as exc:  # mx.load raises on k-quants and other types it cannot read
        raise ModelLoadError(f"MLX cannot read {path}: {exc} (the MLX engine reads GGUF tensors in "
                             "F32, F16, Q4_0, Q4_1 and Q8_0 only)") from None
    args = llama.ModelArgs(**{**gguf_model_args(meta, raw), **(rope or {})})
    weights = rename_gguf(raw)
    model = llama.Model(args)

    def quant_params(module_path: str, module) -> dict | bool:
        scales = weights.get(f"{module_path}.scales")
        if scales is None or not hasattr(module, "to_quantized"):
            return False
        in_features = scales.shape[-1] * GROUP_SIZE
        bits = weights[f"{module_path}.weight"].shape[-1] * 32 // in_features
        return {"group_size": GROUP_SIZE, "bits": bits}

    nn.quantize(model, class_predicate=quant_params)
    model.load_weights(list(weights.items()), strict=True)
    model.eval()
    mx.eval(model.parameters())
    return model, meta


def load_directory(path: str, rope: dict | None = None):
    """(model, config) for an mlx-lm model directory (HF safetensors or MLX-converted); ``rope``:
    config fields laid over its config.json's (and its text_config's), rope_config.overrides."""
    import json
    from pathlib import Path

    from mlx_lm.utils import load_model

    with open(os.path.join(path, "config.json")) as fh:
        config = json.load(fh)
    fields = transformers5_fields(config)
    if rope:
        fields.update(rope)
        if isinstance(config.get("text_config"), dict):
            fields["text_config"] = {**config["text_config"], **fields.get("text_config", {}), **rope}
    model, config = load_model(Path(path), model_config=fields or None)
    return model, config


def _rope_fields(config: dict) -> dict:
    """``rope_theta`` (and Gemma 3's ``rope_local_base_freq``) where transformers 5 wrote them
    only into ``rope_parameters``, which some mlx-lm classes (qwen2, gemma3_text) do not read:
    they would run their default base instead (Qwen2's 1 000 000), a different model."""
    rope = config.get("rope_parameters") or {}
    out = {}
    if "rope_theta" not in config:
        if rope.get("rope_theta") is not None:
            out["rope_theta"] = rope["rope_theta"]
        elif (rope.get("full_attention") or {}).get("rope_theta") is not None:  # Gemma 3: per layer kind
            out["rope_theta"] = rope["full_attention"]["rope_theta"]
    local = (rope.get("sliding_attention") or {}).get("rope_theta")
    if local is not None and "rope_local_base_freq" not in config:
        out["rope_local_base_freq"] = local
    return out


def transformers5_fields(config: dict) -> dict:
    """The config fields to add so mlx-lm reads a directory transformers 5 saved as transformers
    4's would read (top level, and a vision-language model's ``text_config``)."""
    out = _rope_fields(config)
    text = config.get("text_config")
    if isinstance(text, dict):
        fields = _rope_fields(text)
        if fields:
            out["text_config"] = {**text, **fields}
        if config.get("model_type") == "gemma3" and text.get("vocab_size") and "vocab_size" not in config:
            # mlx-lm's gemma3 takes the vocabulary's size from the top level (default: Gemma 3's
            # 262 208), where transformers 5 writes it only into text_config
            out["vocab_size"] = int(text["vocab_size"])
    return out


def is_model_directory(path: str) -> bool:
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, "config.json"))


def load(path: str, rope: dict | None = None):
    """The model for a path: a GGUF file or an mlx-lm directory (``rope``: the rope options' fields)."""
    if is_model_directory(path):
        return load_directory(path, rope)[0]
    return load_gguf(path, rope)[0]
