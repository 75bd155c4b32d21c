"""basert's decoder-only transformer: llama, qwen2, qwen3 and gemma3 as one module driven by a ModelShape.

The model sees a flat batch: tokens and positions of several sequences concatenated, with no
padding. Everything per-token (embedding, norms, projections, RoPE, MLP) runs on the flat batch;
only attention needs to know which token belongs to which sequence, and that is the attention
object's job (``DenseAttention`` here, the paged KV pool in the engine). The numerics follow
transformers' modeling code (norms in float32, RoPE tables in float32 then cast, Gemma's
``(x * w).to(dtype)`` against Llama's ``x.to(dtype) * w``) so fp32 logits agree to 1e-4.
"""

from __future__ import annotations

import math
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from . import rope, unfilled
from .shape import SUPPORTED_ARCHS, ModelShape, expected_shapes
from .weights import read_weights

__all__ = ["SUPPORTED_ARCHS", "Attention", "Transformer", "load", "random_model", "rope_inv_freq"]


class Attention(Protocol):
    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
               window: int | None, scale: float, softcap: float | None) -> torch.Tensor: ...


class RMSNorm(nn.Module):
    """RMSNorm whose weight is the full multiplier (Gemma's HF ``1 + w`` already added at load).

    ``scale_in_float``: Gemma multiplies before casting back to the model dtype (weight kept in
    float32); Llama and Qwen cast first and multiply in the model dtype."""

    def __init__(self, dim: int, eps: float, scale_in_float: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps
        self.scale_in_float = scale_in_float

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.scale_in_float:
            return (xf * self.weight.float()).to(x.dtype)
        return self.weight * xf.to(x.dtype)


def rope_inv_freq(shape: ModelShape, local: bool) -> torch.Tensor:
    """float32 [head_dim/2] inverse frequencies of a global or a local (sliding) layer."""
    base = shape.local_rope_theta if local and shape.local_rope_theta else shape.rope_theta
    d = shape.head_dim
    inv = 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    if local and shape.local_rope_theta:
        return inv  # gemma3's local layers are never context-extended
    if shape.rope_freq_factors is not None:
        inv = inv / torch.tensor(shape.rope_freq_factors, dtype=torch.float32)
    scaling = shape.rope_scaling
    if scaling is None:
        return inv
    if scaling.kind in ("linear", "yarn"):  # rope.py: --rope-scaling / a config's linear or yarn
        return rope.scaled_inv_freq(inv, scaling, d, base, scaling.original_max_position or shape.max_position)
    # llama3: long wavelengths slowed by ``factor``, short ones kept, a linear blend between.
    low_wavelen = scaling.original_max_position / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / scaling.factor, inv)
    smooth = (scaling.original_max_position / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor)
    blended = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, blended, scaled)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Layer(nn.Module):
    """One decoder block; which optional parts exist is read off the shape."""

    def __init__(self, shape: ModelShape, index: int) -> None:
        super().__init__()
        h, d, gemma = shape.hidden_size, shape.head_dim, shape.norm_plus_one
        self.index = index
        self.window = shape.windows[index]
        self.attn_norm = RMSNorm(h, shape.rms_eps, gemma)
        self.q = nn.Linear(h, shape.n_heads * d, bias=shape.qkv_bias)
        self.k = nn.Linear(h, shape.n_kv_heads * d, bias=shape.qkv_bias)
        self.v = nn.Linear(h, shape.n_kv_heads * d, bias=shape.qkv_bias)
        self.o = nn.Linear(shape.n_heads * d, h, bias=shape.o_bias)
        self.q_norm = RMSNorm(d, shape.rms_eps, gemma) if shape.qk_norm else None
        self.k_norm = RMSNorm(d, shape.rms_eps, gemma) if shape.qk_norm else None
        self.post_attn_norm = RMSNorm(h, shape.rms_eps, gemma) if shape.sandwich_norm else None
        self.ffn_norm = RMSNorm(h, shape.rms_eps, gemma)
        self.post_ffn_norm = RMSNorm(h, shape.rms_eps, gemma) if shape.sandwich_norm else None
        self.gate = nn.Linear(h, shape.intermediate_size, bias=False)
        self.up = nn.Linear(h, shape.intermediate_size, bias=False)
        self.down = nn.Linear(shape.intermediate_size, h, bias=False)
        self.gelu = shape.activation == "gelu_tanh"
        self.n_heads, self.n_kv_heads, self.head_dim = shape.n_heads, shape.n_kv_heads, d
        self.scale, self.softcap = shape.attn_scale, shape.attn_softcap

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: Attention) -> torch.Tensor:
        t = x.shape[0]
        h = self.attn_norm(x)
        q = self.q(h).view(t, self.n_heads, self.head_dim)
        k = self.k(h).view(t, self.n_kv_heads, self.head_dim)
        v = self.v(h).view(t, self.n_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        a = attn.attend(self.index, q, k, v, window=self.window, scale=self.scale, softcap=self.softcap)
        a = self.o(a.reshape(t, self.n_heads * self.head_dim))
        if self.post_attn_norm is not None:
            a = self.post_attn_norm(a)
        x = x + a
        h = self.ffn_norm(x)
        g = F.gelu(self.gate(h), approximate="tanh") if self.gelu else F.silu(self.gate(h))
        m = self.down(g * self.up(h))
        if self.post_ffn_norm is not None:
            m = self.post_ffn_norm(m)
        return x + m


class Transformer(nn.Module):
    """The whole decoder; ``forward`` to hidden states, ``logits`` for the rows that need them."""

    def __init__(self, shape: ModelShape) -> None:
        super().__init__()
        self.shape = shape
        self.embed = unfilled.embedding(shape.vocab_size, shape.hidden_size)
        self.layers = nn.ModuleList(Layer(shape, i) for i in range(shape.n_layers))
        self.norm = RMSNorm(shape.hidden_size, shape.rms_eps, shape.norm_plus_one)
        self.head = None if shape.tie_embeddings else nn.Linear(shape.hidden_size, shape.vocab_size, bias=False)
        self.set_buffers(None)
        for p in self.parameters():
            p.requires_grad_(False)

    def set_buffers(self, device: torch.device | str | None) -> None:
        """(Re)make the derived float32 constants (RoPE tables, Gemma's embedding scale) on ``device``:
        never loaded from a file, so a model built on the meta device needs them made afresh."""
        with torch.device("cpu"):  # even inside build()'s meta device: see unfilled.py for why
            inv_global, inv_local = rope_inv_freq(self.shape, local=False), rope_inv_freq(self.shape, local=True)
        self.register_buffer("inv_freq_global", inv_global.to(device), persistent=False)
        self.register_buffer("inv_freq_local", inv_local.to(device), persistent=False)
        self.rope_attention = rope.attention_factor(self.shape.rope_scaling)  # YaRN's cos/sin factor (global layers)
        # HF keeps sqrt(hidden) as a float32 buffer and casts it to the weights' dtype: same here.
        self.register_buffer("embed_scale", torch.tensor(self.shape.embed_scale, device=device), persistent=False)

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.weight.dtype

    def _rope(self, positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype, scale: float = 1.0):
        freqs = positions.float()[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]  # [T, 1, head_dim], broadcast over heads
        if scale != 1.0:
            return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, attn: Attention,
                rows: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """tokens, positions: flat [T]. Returns the final-normed hidden states [T, hidden].

        ``rows`` = (index [N], embeddings [N, hidden]): input rows that are not tokens (an image's
        rows from the vision tower, core/media.py), which replace the token embeddings at those
        flat indices; the tokens there are never read (any valid id will do). They enter as they
        are: no embedding scale, which is a property of the token table."""
        x = self.embed(tokens)
        if self.shape.embed_scale != 1.0:
            x = x * self.embed_scale.to(x.dtype)
        if rows is not None:
            index, values = rows
            x = x.index_copy(0, index, values.to(x.dtype))
        rope_global = self._rope(positions, self.inv_freq_global, x.dtype, self.rope_attention)
        rope_local = (self._rope(positions, self.inv_freq_local, x.dtype)
                      if self.shape.local_rope_theta else rope_global)
        for layer in self.layers:
            cos, sin = rope_local if layer.window is not None else rope_global
            x = layer(x, cos, sin, attn)
        return self.norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> float32 [N, vocab]: the head (tied or not), then any final soft-cap."""
        weight = self.embed.weight if self.head is None else self.head.weight
        out = F.linear(hidden, weight).float()
        cap = self.shape.final_softcap
        if cap is not None:
            out = torch.tanh(out / cap) * cap
        return out


def build(shape: ModelShape, tensors: dict[str, torch.Tensor], device: torch.device | str,
          dtype: torch.dtype) -> Transformer:
    """A Transformer holding ``tensors`` (validated, internal names, on the CPU) on ``device``.

    Built on the meta device and then given the real tensors, so no throwaway random init is
    ever allocated. Gemma's norm weights stay float32: they are multiplied in float32."""
    with torch.device("meta"):
        model = Transformer(shape)
    state = {}
    for key, value in tensors.items():
        keep_float = shape.norm_plus_one and key.endswith("norm.weight")
        state[key] = value.to(device=device, dtype=torch.float32 if keep_float else dtype)
    model.load_state_dict(state, strict=True, assign=True)
    model.set_buffers(device)
    for p in model.parameters():
        p.requires_grad_(False)
    return model.eval()


def load(path: str, *, name: str, device: torch.device | str, dtype: torch.dtype) -> Transformer:
    """Load a .gguf file or an HF directory (config.json + safetensors) onto ``device``.

    Everything is read and checked on the CPU first, so a bad file raises ConfigError (its
    message starts ``model {name!r}:``) before anything reaches the device."""
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"dtype must be float32 or bfloat16, not {dtype}")
    shape, tensors = read_weights(path, name=name, dtype=dtype)
    return build(shape, tensors, device, dtype)


def random_model(shape: ModelShape, *, device: torch.device | str, dtype: torch.dtype,
                 seed: int = 0) -> Transformer:
    """Random weights of a real shape, drawn on ``device`` (for benchmarks, not for text).

    std 0.02 with the residual-writing projections (o, down) shrunk by 1/sqrt(2 * n_layers),
    GPT-2 style, so the residual stream stays O(1) and activations finite even in bf16."""
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    residual_std = 0.02 / math.sqrt(2 * shape.n_layers)
    tensors: dict[str, torch.Tensor] = {}
    for key, size in expected_shapes(shape).items():
        keep_float = shape.norm_plus_one and key.endswith("norm.weight")
        t = torch.empty(size, device=device, dtype=torch.float32 if keep_float else dtype)
        if key.endswith("norm.weight"):
            t.fill_(1.0)
        elif key.endswith(".bias"):
            t.zero_()
        else:
            std = residual_std if key.endswith(("o.weight", "down.weight")) else 0.02
            t.normal_(0.0, std, generator=gen)
        tensors[key] = t
    return build(shape, tensors, device, dtype)
