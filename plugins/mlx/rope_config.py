"""The rope options (--rope-scaling, --rope-scale, --rope-freq-base, --yarn-*) on the MLX engine, as
the model-config fields mlx-lm builds its RoPE from (daemon side; no MLX import).

mlx-lm makes each attention layer's RoPE from its config's ``rope_theta`` and ``rope_scaling``
(``initialize_rope``: ``linear`` is ``nn.RoPE`` with ``scale = 1 / factor``; ``yarn`` its
``YarnRoPE`` with ``factor``, ``original_max_position_embeddings``, ``beta_fast``,
``beta_slow`` and ``mscale``, whose frequencies and cos/sin factor are transformers' YaRN). So
the options become those fields (:func:`overrides`), and the worker's loader lays them over
the model's own config (a directory's config.json, a GGUF's model arguments, a SmolVLM's
language half) before mlx-lm builds the model: the model served is exactly the one mlx-lm builds
from a config.json that says the same.

The meanings are llama-server's, as on the other engines: ``--rope-scale F`` is the factor (0:
the model's own, else 1); ``--yarn-orig-ctx`` the original window (0: the model's own, else its
training context); ``--yarn-attn-factor A`` multiplies YaRN's ``0.1 ln F + 1`` (llama.cpp's
``attn_factor``), which mlx-lm takes as an ``mscale`` of ``(A (0.1 ln F + 1) - 1) / (0.1 ln F)``.
mlx-lm has no extrapolation mix, so ``--yarn-ext-factor`` is accepted only at its value for the
scaling (1 under yarn, 0 under linear), and linear takes no attention factor: anything else is a
ConfigError naming the engine."""

from __future__ import annotations

import json
import math
import os
from typing import Any

from superfluid.core.errors import ConfigError


def own_rope(path: str) -> tuple[dict | None, int]:
    """(the model's own rope_scaling, its training window) from a directory's config.json (its
    text_config for a vision-language one); (None, 0) for a GGUF (the MLX loader refuses a GGUF's
    own rope scaling, and the window comes from the vocabulary)."""
    if not os.path.isdir(path):
        return None, 0
    with open(os.path.join(path, "config.json")) as fh:
        config = json.load(fh)
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    scaling = text.get("rope_scaling") or text.get("rope_parameters")
    if isinstance(scaling, dict) and "full_attention" in scaling:  # Gemma 3: per layer kind
        scaling = scaling["full_attention"]
    kind = (scaling or {}).get("rope_type") or (scaling or {}).get("type")
    return (scaling if kind and kind != "default" else None), int(text.get("max_position_embeddings") or 0)


def _refuse(model: str, why: str) -> ConfigError:
    return ConfigError(f"model {model!r}: engine 'mlx' cannot apply the rope options: {why}")


def overrides(core: Any, path: str, n_ctx_train: int, model: str) -> dict:
    """The config fields (``rope_scaling``, ``rope_theta``) the options ask for; {} when none is set."""
    out: dict = {}
    if core.rope_freq_base and core.rope_freq_base > 0:
        out["rope_theta"] = float(core.rope_freq_base)
    kind = core.rope_scaling
    yarn_given = [v for v in (core.yarn_ext_factor, core.yarn_attn_factor, core.yarn_beta_fast, core.yarn_beta_slow)
                  if v >= 0]
    if kind is None and core.rope_scale <= 0 and not yarn_given and core.yarn_orig_ctx <= 0:
        return out
    if kind == "none":
        out["rope_scaling"] = None
        return out
    own, window = own_rope(path)
    own_kind = (own or {}).get("rope_type") or (own or {}).get("type")
    if own_kind not in (None, "linear", "yarn"):
        raise _refuse(model, f"the model brings {own_kind!r} rope scaling of its own; use --rope-scaling none "
                             "with them, or leave them out")
    kind = kind or own_kind or "linear"
    same = own if own_kind == kind else {}
    factor = float(core.rope_scale if core.rope_scale > 0 else same.get("factor", 1.0))
    ext = core.yarn_ext_factor
    if kind == "linear":
        if ext > 0 or core.yarn_attn_factor not in (-1.0, 1.0) or core.yarn_beta_fast >= 0 or core.yarn_beta_slow >= 0:
            raise _refuse(model, "linear scaling in mlx-lm takes only --rope-scale (no YaRN mix, betas or "
                                 "attention factor); use --rope-scaling yarn for those")
        out["rope_scaling"] = {"rope_type": "linear", "factor": factor}
        return out
    if ext >= 0 and ext != 1.0:
        raise _refuse(model, f"--yarn-ext-factor {ext}: mlx-lm's YaRN has no extrapolation mix (only 1)")
    original = core.yarn_orig_ctx or same.get("original_max_position_embeddings") or window or n_ctx_train
    scaling = {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": int(original)}
    for key, value in (("beta_fast", core.yarn_beta_fast), ("beta_slow", core.yarn_beta_slow)):
        if value >= 0:
            scaling[key] = float(value)
        elif same.get(key) is not None:
            scaling[key] = float(same[key])
    attention = None
    if core.yarn_attn_factor >= 0:
        attention = core.yarn_attn_factor * (0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0)
    elif core.rope_scale <= 0 and same.get("attention_factor") is not None:
        attention = float(same["attention_factor"])
    elif same.get("mscale") is not None:  # a config's own mscale / mscale_all_dim pass as they are
        scaling.update({k: same[k] for k in ("mscale", "mscale_all_dim") if same.get(k) is not None})
    if attention is not None and attention != (0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0):
        if factor <= 1:
            raise _refuse(model, "mlx-lm's YaRN scales attention only with a --rope-scale above 1")
        scaling["mscale"] = (attention - 1.0) / (0.1 * math.log(factor))
        scaling["mscale_all_dim"] = 0.0
    out["rope_scaling"] = scaling
    return out
