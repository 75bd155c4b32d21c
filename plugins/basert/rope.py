"""RoPE context extension on basert: linear and YaRN frequencies and YaRN's attention factor, and
the per-model options (``--rope-scaling``, ``--rope-scale``, ``--yarn-*``, ``--rope-freq-base``)
applied to a model's shape.

The rule is llama.cpp's (ggml's ``rope_yarn``), which contains Hugging Face transformers' two
(``_compute_linear_scaling_rope_parameters``, ``_compute_yarn_parameters``) as cases. For a
head of ``d`` and base ``b``, frequency ``i`` (of ``d / 2``) is ``inv_i = b^(-2i/d)``; with the
context multiple ``s`` (``factor``):

* the interpolated frequency is ``inv_i / s`` and the extrapolated one ``inv_i``;
* YaRN keeps the fast-turning frequencies (those that turn more than ``beta_fast`` times over
  the original context ``L``) and interpolates the slow ones (fewer than ``beta_slow`` turns),
  with a linear ramp between: frequency ``i`` turns ``L · inv_i / 2π`` times, so the ramp runs
  from dimension ``low = floor(d · ln(L / (2π · beta_fast)) / (2 ln b))`` to
  ``high = ceil(d · ln(L / (2π · beta_slow)) / (2 ln b))`` (clamped to ``[0, d - 1]``), and the
  extrapolation weight is ``γ_i = 1 - clamp((i - low) / (high - low), 0, 1)``;
* the frequency used is ``inv_i / s · (1 - e·γ_i) + inv_i · e·γ_i``, ``e`` the extrapolation mix
  (``--yarn-ext-factor``: 1 under YaRN, 0 under linear, which is then plain interpolation);
* cos and sin are multiplied by the attention factor: ``a · (0.1 ln s + 1)`` where the mix is not
  0 (YaRN's "mscale", ``a`` = ``--yarn-attn-factor``, 1 by default), ``a`` otherwise, unless the
  model's config states its own ``attention_factor`` (transformers' meaning: the whole factor).

So with the defaults, linear equals transformers' ``linear`` and YaRN its ``yarn`` on the same
``factor``, ``original_max_position_embeddings``, ``beta_fast`` and ``beta_slow``.

An option left at its default keeps the model's own value (its config's ``rope_scaling``);
``--rope-scaling none`` drops the model's scaling; ``--rope-scale F`` is the factor (0: the
model's own, else 1, as llama-server leaves ``rope_freq_scale`` at the model's)."""

from __future__ import annotations

import math
from typing import Any

import attrs
import torch

from superfluid.core.errors import ConfigError

from .rope_scaling import BETA_FAST, BETA_SLOW, RopeScaling, mscale
from .shape import ModelShape


def correction_range(scaling: RopeScaling, dim: int, base: float, original: int) -> tuple[float, float]:
    """The dimensions (of ``dim / 2``) where YaRN's ramp starts and ends."""
    def turns_dim(turns: float) -> float:
        return dim * math.log(original / (turns * 2 * math.pi)) / (2 * math.log(base))

    low, high = math.floor(turns_dim(scaling.beta_fast)), math.ceil(turns_dim(scaling.beta_slow))
    return max(low, 0), min(high, dim - 1)


def scaled_inv_freq(inv: torch.Tensor, scaling: RopeScaling, dim: int, base: float, original: int) -> torch.Tensor:
    """``inv`` (float32 [dim/2]) under linear or YaRN scaling (``original``: the context the model
    was trained on, the ramp's ``L``)."""
    interpolated = inv / scaling.factor
    if not scaling.ext_factor:
        return interpolated
    low, high = correction_range(scaling, dim, base, original)
    if low == high:
        high += 0.001  # a ramp of one step (transformers and ggml alike)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolate = (1 - ramp) * scaling.ext_factor
    return interpolated * (1 - extrapolate) + inv * extrapolate


def attention_factor(scaling: RopeScaling | None) -> float:
    """What cos and sin are multiplied by (1.0: no scaling, or linear with no factor given)."""
    if scaling is None or scaling.kind not in ("linear", "yarn"):
        return 1.0
    if scaling.attention is not None:
        return scaling.attention
    return scaling.attn_factor * (mscale(scaling.factor) if scaling.ext_factor else 1.0)


def with_options(shape: ModelShape, core: Any, name: str) -> ModelShape:
    """``shape`` with the model's rope options (``CORE_OPTIONS.of(model)``) applied to its global
    layers' RoPE (module docstring). ConfigError for what basert cannot combine: the options on a
    model whose own scaling is llama3 or per-frequency factors, unless ``--rope-scaling none``."""
    own = shape.rope_scaling
    if core.rope_freq_base and core.rope_freq_base > 0:
        shape = attrs.evolve(shape, rope_theta=float(core.rope_freq_base))
    kind = core.rope_scaling
    asked = kind is not None or core.rope_scale > 0 or any(
        v >= 0 for v in (core.yarn_ext_factor, core.yarn_attn_factor, core.yarn_beta_fast, core.yarn_beta_slow)
    ) or core.yarn_orig_ctx > 0
    if not asked:
        return shape
    if kind == "none":
        return attrs.evolve(shape, rope_scaling=None, rope_freq_factors=None)
    if shape.rope_freq_factors is not None or (own is not None and own.kind == "llama3"):
        raise ConfigError(f"model {name!r}: engine 'basert' cannot apply rope options to a model that brings "
                          f"llama3 rope scaling of its own; use --rope-scaling none with them, or leave them out")
    kind = kind or (own.kind if own is not None else "linear")
    same = own if own is not None and own.kind == kind else None
    factor = core.rope_scale if core.rope_scale > 0 else (same.factor if same else 1.0)
    original = core.yarn_orig_ctx or (same.original_max_position if same else 0) or shape.max_position
    default_mix = 1.0 if kind == "yarn" else 0.0
    scaling = RopeScaling(
        kind, float(factor), original_max_position=int(original),
        beta_fast=core.yarn_beta_fast if core.yarn_beta_fast >= 0 else (same.beta_fast if same else BETA_FAST),
        beta_slow=core.yarn_beta_slow if core.yarn_beta_slow >= 0 else (same.beta_slow if same else BETA_SLOW),
        ext_factor=core.yarn_ext_factor if core.yarn_ext_factor >= 0 else default_mix,
        attn_factor=core.yarn_attn_factor if core.yarn_attn_factor >= 0 else 1.0,
        # the config's own whole factor holds unless a factor or attention scale is given here
        attention=same.attention if same and core.rope_scale <= 0 and core.yarn_attn_factor < 0 else None)
    return attrs.evolve(shape, rope_scaling=scaling)


def apply(model, core: Any, name: str, device) -> None:
    """Apply the rope options to a loaded model (its shape, and the RoPE tables made from it)."""
    shape = with_options(model.shape, core, name)
    if shape != model.shape:
        model.shape = shape
        model.set_buffers(device)
