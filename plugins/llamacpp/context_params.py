"""The context parameters a model's core options set on llama.cpp: the KV cache types
(``--kv-bits``) and the rope/YaRN knobs (``--rope-scaling``, ``--rope-scale``, ``--yarn-*``).

Decided in the daemon (:func:`context_settings`, which refuses what llama.cpp would refuse, with
the reason) and applied in the worker (:func:`apply`) to ``llama_context_params``. The mapping is
llama-server's (common/arg.cpp): ``--rope-scale F`` is ``rope_freq_scale = 1/F``; 0 and negative
values leave llama.cpp to take the model's own."""

from __future__ import annotations

import attrs

from superfluid.core.errors import ConfigError

# --kv-bits → the ggml cache type of K and V (names as kvpool.shape.CACHE_TYPES and llama.cpp's log spell them)
KV_TYPES = {0: "f16", 8: "q8_0", 4: "q4_0"}
GGML_TYPES = {"f16": 1, "q4_0": 2, "q8_0": 8}  # ggml_type: GGML_TYPE_F16, _Q4_0, _Q8_0
ROPE_SCALING_TYPES = {None: -1, "none": 0, "linear": 1, "yarn": 2}  # llama_rope_scaling_type
FLASH_ON, FLASH_OFF, FLASH_AUTO = 1, 0, -1  # llama_flash_attn_type


@attrs.frozen
class ContextSettings:
    """What the worker sets on ``llama_context_params`` beyond the pool's layout."""

    type_k: str = "f16"
    type_v: str = "f16"
    rope_scaling: str | None = None  # None: the model's own
    rope_freq_scale: float = 0.0     # 0: the model's own
    rope_freq_base: float = 0.0
    yarn_orig_ctx: int = 0
    yarn_ext_factor: float = -1.0
    yarn_attn_factor: float = -1.0
    yarn_beta_fast: float = -1.0
    yarn_beta_slow: float = -1.0

    @property
    def quantized(self) -> bool:
        return self.type_k != "f16" or self.type_v != "f16"

    def describe(self) -> dict:
        return attrs.asdict(self)


def context_settings(core, flash_attn: int, model: str) -> tuple[ContextSettings, int]:
    """(the settings, the flash attention type to use) from ``core`` (``CORE_OPTIONS.of(model)``).
    A quantized V cache needs flash attention: ``auto`` becomes ``on``; ``off`` is refused."""
    bits = int(core.kv_bits or 0)
    kv_type = KV_TYPES[bits]
    if bits and flash_attn == FLASH_OFF:
        raise ConfigError(f"model {model!r}: kv-bits {bits} stores V as {kv_type}, and llama.cpp reads a quantized "
                          "V cache only with flash attention; drop --flash-attn off (auto turns it on) or "
                          "drop --kv-bits")
    if bits:
        flash_attn = FLASH_ON
    scale = float(core.rope_scale or 0.0)
    settings = ContextSettings(
        type_k=kv_type, type_v=kv_type, rope_scaling=core.rope_scaling,
        rope_freq_scale=1.0 / scale if scale > 0 else 0.0, rope_freq_base=float(core.rope_freq_base or 0.0),
        yarn_orig_ctx=int(core.yarn_orig_ctx or 0), yarn_ext_factor=float(core.yarn_ext_factor),
        yarn_attn_factor=float(core.yarn_attn_factor), yarn_beta_fast=float(core.yarn_beta_fast),
        yarn_beta_slow=float(core.yarn_beta_slow))
    return settings, flash_attn


def apply(cparams, settings: ContextSettings) -> None:
    """Set ``settings`` on a ``llama_context_params``."""
    cparams.type_k = GGML_TYPES[settings.type_k]
    cparams.type_v = GGML_TYPES[settings.type_v]
    cparams.rope_scaling_type = ROPE_SCALING_TYPES[settings.rope_scaling]
    cparams.rope_freq_base = settings.rope_freq_base
    cparams.rope_freq_scale = settings.rope_freq_scale
    cparams.yarn_orig_ctx = settings.yarn_orig_ctx
    cparams.yarn_ext_factor = settings.yarn_ext_factor
    cparams.yarn_attn_factor = settings.yarn_attn_factor
    cparams.yarn_beta_fast = settings.yarn_beta_fast
    cparams.yarn_beta_slow = settings.yarn_beta_slow



def describe_context(settings: ContextSettings) -> str:
    """The ready line's words for the KV types and any rope setting."""
    words = [f"K {settings.type_k}, V {settings.type_v}" + (" (--kv-bits)" if settings.quantized else "")]
    if settings.rope_scaling is not None or settings.rope_freq_scale:
        words.append("rope scaling " + (settings.rope_scaling or "the model's")
                     + (f" x{1 / settings.rope_freq_scale:g}" if settings.rope_freq_scale else "")
                     + (f" from {settings.yarn_orig_ctx}" if settings.yarn_orig_ctx else ""))
    return ", ".join(words)
