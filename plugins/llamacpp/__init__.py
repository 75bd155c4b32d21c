"""llama.cpp through llama-cpp-python's low-level API, in a supervised worker process."""

from superfluid.core.config import Option, in_range
from superfluid.core.hookspecs import hookimpl

from .extra_buffers import one_of_modes

FLASH_ATTN = {"auto": -1, "off": 0, "on": 1}  # llama_flash_attn_type


def one_of_flash_attn(value):
    return None if value in FLASH_ATTN else f"must be one of {', '.join(FLASH_ATTN)}"


OPTIONS = [
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
    Option("kv-pool-cells", int, 0, "llama.cpp: cells in the shared KV pool (--kv-unified, sliding-window and "
           "recurrent models), at least --max-context (0: lanes × context, capped by free memory); in a pool smaller than lanes × context, "
           "lanes beyond what it holds queue; basert reads it as its paged pool's tokens", in_range(0, 1 << 24), model_scoped=True, metavar="N"),
]


@hookimpl
def superfluid_add_config(schema):
    for option in OPTIONS:
        schema.add(option)


@hookimpl
def superfluid_add_engines(register):
    from .engine import LlamaCppEngine
    register("llamacpp", LlamaCppEngine)
