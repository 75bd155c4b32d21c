"""The shape of a basert transformer: every number the model, the KV pool and the rooflines need,
and every tensor the model holds (``expected_shapes``, what the weight readers check files against).

One frozen record per model, built from an HF ``config.json`` (``ModelShape.from_hf_config``) or
from GGUF metadata (``weights.py``), so that the four supported architectures (llama, qwen2, qwen3,
gemma3) differ only in data, never in code paths chosen by name inside the model. It also lets a
GPU benchmark build a random-weight model of a real shape (Llama-3.1-8B) from its config alone.
"""

from __future__ import annotations

import math
from typing import Any

import attrs

from superfluid.core.errors import ConfigError

from .rope_scaling import RopeScaling, parse_rope_scaling  # noqa: F401  (RopeScaling: weights.py reads it here)

SUPPORTED_ARCHS = ("llama", "qwen2", "qwen3", "gemma3")

# HF ``model_type`` -> basert arch. Gemma 3's text-only checkpoints say "gemma3_text".
HF_MODEL_TYPES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3_text": "gemma3",
                  # the language halves of Qwen2.5-VL and Qwen3-VL: Qwen2's and Qwen3's blocks, whose
                  # multimodal RoPE is plain RoPE on text (its three position streams are equal there)
                  "qwen2_5_vl_text": "qwen2", "qwen3_vl_text": "qwen3"}

# HF vision-language ``model_type`` -> where its language half's weights are: the prefix that
# stands where a text-only checkpoint says ``model.`` (its head stays ``lm_head.weight``). Its
# config nests the language half's under ``text_config``; the vision half is :mod:`.vision`'s.
HF_VLM_TEXT_PREFIX = {"idefics3": "model.text_model.", "gemma3": "language_model.model.",
                      "qwen2_5_vl": "model.", "qwen3_vl": "model.language_model.",
                      "llava_next": "language_model.model."}
# ... and where its head is, where not ``lm_head.`` (llava-hf's LLaVA-NeXT checkpoints)
HF_VLM_HEAD_PREFIX = {"llava_next": "language_model.lm_head."}


def hf_text_config(config: dict[str, Any], name: str = "config.json") -> tuple[dict[str, Any], str]:
    """(the language half's config, the prefix its weights carry instead of ``model.``): a
    text-only config as it is; a SmolVLM / Idefics3 one's ``text_config``, whose weights are
    under ``model.text_model.``."""
    prefix = HF_VLM_TEXT_PREFIX.get(config.get("model_type"))
    if prefix is None:
        return config, "model."
    text = dict(config.get("text_config") or {})
    if not text.get("model_type"):
        raise ConfigError(f"model {name!r}: a {config.get('model_type')} config without a text_config model_type")
    return text, prefix


def hf_architecture(config: dict[str, Any], name: str = "config.json") -> str:
    """The basert arch of an HF config's language half (its own ``model_type`` if basert has none)."""
    text, _ = hf_text_config(config, name)
    model_type = str(text.get("model_type") or "")
    return HF_MODEL_TYPES.get(model_type, model_type)


@attrs.define(frozen=True)
class ModelShape:
    arch: str                 # "llama" | "qwen2" | "qwen3" | "gemma3"
    vocab_size: int
    hidden_size: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_eps: float
    rope_theta: float
    max_position: int         # training context
    tie_embeddings: bool
    windows: tuple[int | None, ...]   # per layer: keys j with i - j < window visible, or None (global)
    attn_scale: float         # softmax scale
    attn_softcap: float | None = None
    final_softcap: float | None = None
    # RoPE base of the sliding-window layers when it differs from the global one (gemma3: 10 000).
    local_rope_theta: float | None = None
    # Applies to global layers only (gemma3's local layers are never scaled).
    rope_scaling: RopeScaling | None = None
    # llama.cpp's per-frequency divisors (a GGUF ``rope_freqs`` tensor), head_dim/2 of them.
    rope_freq_factors: tuple[float, ...] | None = None
    qkv_bias: bool = False    # qwen2 (and llama with attention_bias)
    o_bias: bool = False      # llama with attention_bias
    qk_norm: bool = False     # qwen3, gemma3: RMSNorm over each head of q and k before RoPE
    sandwich_norm: bool = False   # gemma3: extra norms after attention and after the MLP
    norm_plus_one: bool = False   # gemma3: HF norm weights w mean a multiplier of (1 + w)
    activation: str = "silu"      # "silu" | "gelu_tanh" (the MLP gate)
    embed_scale: float = 1.0      # gemma3: sqrt(hidden), applied in the model dtype as HF does

    def __attrs_post_init__(self) -> None:
        if len(self.windows) != self.n_layers:
            raise ValueError(f"windows has {len(self.windows)} entries for {self.n_layers} layers")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads {self.n_heads} is not a multiple of n_kv_heads {self.n_kv_heads}")

    def param_count(self) -> int:
        """Parameters (norms and biases included), counting a tied head once."""
        h, d = self.hidden_size, self.head_dim
        q_out, kv_out = self.n_heads * d, self.n_kv_heads * d
        per_layer = h * q_out + 2 * h * kv_out + q_out * h + 3 * h * self.intermediate_size
        per_layer += 2 * h + (2 * h if self.sandwich_norm else 0) + (2 * d if self.qk_norm else 0)
        per_layer += (q_out + 2 * kv_out if self.qkv_bias else 0) + (h if self.o_bias else 0)
        embed = self.vocab_size * h
        return embed + (0 if self.tie_embeddings else embed) + self.n_layers * per_layer + h

    def weight_bytes(self, bytes_per_value: float) -> int:
        """Bytes of all weights at ``bytes_per_value`` each: a decode step reads them all once."""
        return int(self.param_count() * bytes_per_value)

    @classmethod
    def from_hf_config(cls, config: dict[str, Any], *, name: str = "config.json") -> "ModelShape":
        """The shape an HF ``config.json`` describes (transformers 4 and 5 spellings alike); for
        a vision-language model, its language half's."""
        config, _ = hf_text_config(config, name)
        model_type = config.get("model_type")
        arch = HF_MODEL_TYPES.get(model_type)
        if arch is None:
            hint = " (use the text-only checkpoint)" if model_type == "gemma3" else ""
            raise ConfigError(f"model {name!r}: architecture {model_type!r} is not supported{hint}; "
                              f"supported: {', '.join(SUPPORTED_ARCHS)}")
        if config.get("mlp_bias"):
            raise ConfigError(f"model {name!r}: mlp_bias is not supported")
        hidden = int(config["hidden_size"])
        n_heads = int(config["num_attention_heads"])
        n_layers = int(config["num_hidden_layers"])
        head_dim = int(config.get("head_dim") or hidden // n_heads)
        global_rope, local_rope = _hf_rope(config, arch, name)
        gemma = arch == "gemma3"
        bias = bool(config.get("attention_bias", False))
        scale = float(config["query_pre_attn_scalar"]) ** -0.5 if gemma else head_dim ** -0.5
        return cls(
            arch=arch,
            vocab_size=int(config["vocab_size"]),
            hidden_size=hidden,
            n_layers=n_layers,
            n_heads=n_heads,
            n_kv_heads=int(config.get("num_key_value_heads") or n_heads),
            head_dim=head_dim,
            intermediate_size=int(config["intermediate_size"]),
            rms_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=global_rope[0],
            max_position=int(config.get("max_position_embeddings", 4096)),
            tie_embeddings=bool(config.get("tie_word_embeddings", gemma)),
            windows=_hf_windows(config, arch, n_layers),
            attn_scale=scale,
            attn_softcap=None,  # Gemma 3 configs carry attn_logit_softcapping but neither HF nor llama.cpp applies it
            final_softcap=_opt_float(config.get("final_logit_softcapping")),
            local_rope_theta=local_rope if gemma else None,
            rope_scaling=global_rope[1],
            qkv_bias=bias or arch == "qwen2",
            o_bias=bias and arch != "qwen2",
            qk_norm=arch in ("qwen3", "gemma3"),
            sandwich_norm=gemma,
            norm_plus_one=gemma,
            activation=_activation(config.get("hidden_activation") or config.get("hidden_act") or "silu", name),
            embed_scale=math.sqrt(hidden) if gemma else 1.0,
        )


def expected_shapes(shape: ModelShape) -> dict[str, tuple[int, ...]]:
    """Every tensor the model needs, by internal name (``model.Transformer``'s parameter names),
    with its shape: the shape decides them, and both the model and the weight readers use them."""
    h, d, ff = shape.hidden_size, shape.head_dim, shape.intermediate_size
    q_out, kv_out = shape.n_heads * d, shape.n_kv_heads * d
    out: dict[str, tuple[int, ...]] = {"embed.weight": (shape.vocab_size, h), "norm.weight": (h,)}
    if not shape.tie_embeddings:
        out["head.weight"] = (shape.vocab_size, h)
    for i in range(shape.n_layers):
        p = f"layers.{i}."
        out.update({p + "attn_norm.weight": (h,), p + "q.weight": (q_out, h), p + "k.weight": (kv_out, h),
                    p + "v.weight": (kv_out, h), p + "o.weight": (h, q_out), p + "ffn_norm.weight": (h,),
                    p + "gate.weight": (ff, h), p + "up.weight": (ff, h), p + "down.weight": (h, ff)})
        if shape.qkv_bias:
            out.update({p + "q.bias": (q_out,), p + "k.bias": (kv_out,), p + "v.bias": (kv_out,)})
        if shape.o_bias:
            out[p + "o.bias"] = (h,)
        if shape.qk_norm:
            out.update({p + "q_norm.weight": (d,), p + "k_norm.weight": (d,)})
        if shape.sandwich_norm:
            out.update({p + "post_attn_norm.weight": (h,), p + "post_ffn_norm.weight": (h,)})
    return out


def _opt_float(value: Any) -> float | None:
    return None if value is None else float(value)


def _activation(act: str, name: str) -> str:
    if act == "silu":
        return "silu"
    if act in ("gelu_pytorch_tanh", "gelu_tanh"):
        return "gelu_tanh"
    raise ConfigError(f"model {name!r}: activation {act!r} is not supported (silu, gelu_pytorch_tanh)")


def _hf_rope(config: dict[str, Any], arch: str, name: str) -> tuple[tuple[float, RopeScaling | None], float]:
    """((global theta, global scaling), local theta) from either transformers spelling."""
    params = config.get("rope_parameters")
    if arch == "gemma3":
        if params and "full_attention" in params:
            full, sliding = params["full_attention"] or {}, params.get("sliding_attention") or {}
            return ((float(full.get("rope_theta", 1e6)), parse_rope_scaling(full, name)),
                    float(sliding.get("rope_theta", 1e4)))
        scaling = config.get("rope_scaling")
        return ((float(config.get("rope_theta", 1e6)), parse_rope_scaling(scaling, name)),
                float(config.get("rope_local_base_freq", 1e4)))
    if params:
        return (float(params.get("rope_theta", 1e4)), parse_rope_scaling(params, name)), 0.0
    return (float(config.get("rope_theta", 1e4)), parse_rope_scaling(config.get("rope_scaling"), name)), 0.0


def _hf_windows(config: dict[str, Any], arch: str, n_layers: int) -> tuple[int | None, ...]:
    window = config.get("sliding_window")
    types = config.get("layer_types")
    if types is None:
        if arch == "gemma3":
            pattern = int(config.get("sliding_window_pattern") or config.get("_sliding_window_pattern") or 6)
            types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n_layers)]
        elif config.get("use_sliding_window") and window:
            first_sliding = int(config.get("max_window_layers", n_layers))
            types = ["sliding_attention" if i >= first_sliding else "full_attention" for i in range(n_layers)]
        else:
            types = ["full_attention"] * n_layers
    if arch in ("qwen2", "qwen3") and not config.get("use_sliding_window"):
        types = ["full_attention"] * n_layers  # the HF models ignore sliding_window unless enabled
    return tuple(int(window) if t == "sliding_attention" and window else None for t in types)
