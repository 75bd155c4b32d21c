"""The per-model options that shape a model's KV and its positions: the KV width (``kv-bits``)
and the longer-context knobs (rope scaling, YaRN, ``allow-long-context``).

They are the core's, not an engine's, because every engine reads them (a plugin reads no other
plugin's key): an engine that implements one applies it, one that does not refuses it at start
with a :class:`ConfigError` naming itself (:func:`refuse_rope_scaling`). The names and meanings
follow llama-server's flags, so a deployment moving here brings its flags along."""

from __future__ import annotations

from typing import Any

from .errors import ConfigError
from .options import Option, in_range

ROPE_SCALINGS = ("none", "linear", "yarn")


def parse_kv_bits(text: str) -> int:
    """``0`` (the engine's full width), ``8`` or ``4``."""
    try:
        return int(text.strip())
    except ValueError:
        raise ConfigError(f"expected 0, 8 or 4, got {text!r}") from None


def _kv_bits_check(value: int) -> str | None:
    return None if value in (0, 8, 4) else "must be one of 0, 8, 4"


def _rope_scaling_check(value: str) -> str | None:
    return None if value in ROPE_SCALINGS else f"must be one of {', '.join(ROPE_SCALINGS)}"


def kv_context_options() -> list[Option]:
    """The options, for :func:`superfluid.core.config.core_options`."""
    return [
        Option("kv-bits", int, 0, "KV cache width on every engine: 0 (the engine's full width), 8 or 4 "
               "(quantized: about 2x / 4x the context or lanes in the same memory, at a small quality cost). "
               "llama.cpp: q8_0 / q4_0 for K and V, with flash attention (refused with --flash-attn off); "
               "basert: per-block scales", _kv_bits_check, model_scoped=True, metavar="0|8|4",
               parse=parse_kv_bits),
        Option("rope-scaling", str, None, "RoPE scaling for a context beyond the training window: none, "
               "linear or yarn (default: the model's own)", _rope_scaling_check, model_scoped=True,
               metavar="none|linear|yarn"),
        Option("rope-scale", float, 0.0, "RoPE context multiple with --rope-scaling: the positions are "
               "stretched by this factor (llama.cpp's rope_freq_scale = 1/F; 0: the model's own)",
               in_range(0.0, 1024.0), model_scoped=True, metavar="F"),
        Option("rope-freq-base", float, 0.0, "RoPE base frequency (0: the model's own)",
               in_range(0.0, 1e12), model_scoped=True, metavar="F"),
        Option("yarn-orig-ctx", int, 0, "YaRN: the model's original context size (0: its training context)",
               in_range(0, 1 << 24), model_scoped=True, metavar="N"),
        Option("yarn-ext-factor", float, -1.0, "YaRN: extrapolation mix factor (0.0: full interpolation; "
               "negative: the model's own, 1.0 under yarn)", in_range(-1.0, 1024.0), model_scoped=True,
               metavar="F"),
        Option("yarn-attn-factor", float, -1.0, "YaRN: attention magnitude scale (negative: the model's own)",
               in_range(-1.0, 1024.0), model_scoped=True, metavar="F"),
        Option("yarn-beta-fast", float, -1.0, "YaRN: low correction dim (negative: the model's own, 32)",
               in_range(-1.0, 1024.0), model_scoped=True, metavar="F"),
        Option("yarn-beta-slow", float, -1.0, "YaRN: high correction dim (negative: the model's own, 1)",
               in_range(-1.0, 1024.0), model_scoped=True, metavar="F"),
        Option("allow-long-context", bool, False, "accept a --max-context above the model's training "
               "window without rope scaling (a warning is logged: past the window the model's output "
               "degrades)", model_scoped=True),
    ]


def rope_scaling_on(core: Any) -> bool:
    """Whether ``core`` (``CORE_OPTIONS.of(model)``) asks for rope scaling: a scaling type other
    than none, or a context multiple above 1."""
    return core.rope_scaling in ("linear", "yarn") or (core.rope_scaling != "none" and core.rope_scale > 1.0)


def rope_options_set(core: Any) -> list[str]:
    """The rope/YaRN options ``core`` sets away from their defaults, as flags (for a refusal)."""
    given = []
    if core.rope_scaling is not None:
        given.append("--rope-scaling")
    for flag, value, default in (("--rope-scale", core.rope_scale, 0.0), ("--rope-freq-base", core.rope_freq_base, 0.0),
                                 ("--yarn-orig-ctx", core.yarn_orig_ctx, 0),
                                 ("--yarn-ext-factor", core.yarn_ext_factor, -1.0),
                                 ("--yarn-attn-factor", core.yarn_attn_factor, -1.0),
                                 ("--yarn-beta-fast", core.yarn_beta_fast, -1.0),
                                 ("--yarn-beta-slow", core.yarn_beta_slow, -1.0)):
        if value != default:
            given.append(flag)
    return given


def refuse_rope_scaling(core: Any, engine: str, model: str) -> None:
    """For an engine that does not implement rope scaling: a :class:`ConfigError` naming the
    engine when any rope/YaRN option is set."""
    given = rope_options_set(core)
    if given:
        raise ConfigError(f"model {model!r}: the {engine} engine does not implement rope scaling "
                          f"({', '.join(given)}); serve the model on an engine that does (llamacpp) "
                          "or leave these options out")
