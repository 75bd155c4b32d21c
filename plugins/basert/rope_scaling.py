"""A model's RoPE scaling as its config states it: the :class:`RopeScaling` record, read from an
HF ``rope_scaling`` / ``rope_parameters`` dict. Its own module because both the model's shape
(which holds one) and the frequency math in :mod:`.rope` (which applies one, and the per-model
options, to a shape) need it."""

from __future__ import annotations

import math
from typing import Any

import attrs

from superfluid.core.errors import ConfigError

BETA_FAST, BETA_SLOW = 32.0, 1.0  # YaRN's defaults (the paper's, transformers' and llama.cpp's)


@attrs.define(frozen=True)
class RopeScaling:
    """A context-extension rule applied to the global layers' RoPE frequencies.

    ``kind`` is "linear" (every frequency divided by ``factor``), "llama3" (low frequencies
    divided by ``factor``, high ones kept, a smooth blend between, as Llama 3.1 was trained) or
    "yarn" (rope.py, which also applies the --rope-scaling / --yarn-* options)."""

    kind: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192
    # "yarn" (and the extrapolation mix of either kind): rope.py's terms, llama.cpp's defaults
    beta_fast: float = BETA_FAST
    beta_slow: float = BETA_SLOW
    ext_factor: float = 0.0           # 1.0 under yarn; 0.0: plain interpolation
    attn_factor: float = 1.0          # multiplies YaRN's mscale
    attention: float | None = None    # a config's own attention_factor: the whole cos/sin factor


def mscale(factor: float, scale: float = 1.0) -> float:
    """YaRN's attention temperature for a context multiple: ``0.1 · scale · ln(factor) + 1``."""
    return 1.0 if factor <= 1 else 0.1 * scale * math.log(factor) + 1.0


def from_hf(params: dict[str, Any]) -> RopeScaling:
    """A YaRN ``rope_scaling`` dict of a config.json (transformers' keys) as a RopeScaling."""
    factor = float(params["factor"])
    attention = params.get("attention_factor")
    if attention is None and params.get("mscale") and params.get("mscale_all_dim"):
        attention = mscale(factor, float(params["mscale"])) / mscale(factor, float(params["mscale_all_dim"]))
    return RopeScaling("yarn", factor, original_max_position=int(params.get("original_max_position_embeddings") or 0),
                       beta_fast=float(params.get("beta_fast") or BETA_FAST),
                       beta_slow=float(params.get("beta_slow") or BETA_SLOW), ext_factor=1.0,
                       attention=None if attention is None else float(attention))


def parse_rope_scaling(params: dict[str, Any] | None, name: str) -> RopeScaling | None:
    """An HF rope dict (``rope_scaling`` or one ``rope_parameters`` entry) as a RopeScaling."""
    if not params:
        return None
    kind = params.get("rope_type") or params.get("type") or "default"
    if kind == "default":
        return None
    if kind == "linear":
        return RopeScaling("linear", float(params["factor"]))
    if kind == "yarn":
        return from_hf(params)
    if kind == "llama3":
        return RopeScaling("llama3", float(params["factor"]), float(params["low_freq_factor"]),
                           float(params["high_freq_factor"]), int(params["original_max_position_embeddings"]))
    raise ConfigError(f"model {name!r}: rope scaling type {kind!r} is not supported (default, linear, llama3, yarn)")
