"""The llama.cpp engine's options, read back typed: ``OPTIONS.of(model).kv_unified``.
(``--kv-pool-cells``, which basert reads too, is the core's.)"""

from superfluid.core.options import Option, PluginOptions

from .extra_buffers import one_of_modes

FLASH_ATTN = {"auto": -1, "off": 0, "on": 1}  # llama_flash_attn_type


def one_of_flash_attn(value):
    return None if value in FLASH_ATTN else f"must be one of {', '.join(FLASH_ATTN)}"


OPTIONS = PluginOptions("llamacpp", [
    Option("flash-attn", str, "auto", "llama.cpp: flash attention (auto, on, off); auto lets llama.cpp decide, as "
           "llama-server does (on for CPUs). Greedy text can differ between on and off",
           one_of_flash_attn, model_scoped=True, metavar="auto|on|off"),
    Option("llama-extra-buffers", str, "auto", "llama.cpp: keep weights in its extra CPU buffer types "
           "(AMX, CPU repacking; llama-server's --no-repack is off). auto: off where llama.cpp's CPU report "
           "names AMX, whose path crashes or computes wrongly, on elsewhere (repacking Q4_0/Q4_K speeds up prefill)",
           one_of_modes, model_scoped=True, metavar="auto|on|off"),
    Option("kv-unified", bool, False, "llama.cpp: one KV pool shared by all lanes for any model, cached "
           "prefixes sharing their cells (sliding-window and recurrent models always get one)",
           model_scoped=True),
])
