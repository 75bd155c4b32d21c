"""Which torch device, dtype and decode path a basert model runs on, from its flags: each
checked before anything loads, and a ConfigError naming the model and the flag when the machine
cannot honour it. Its own module so that tools (``tools/gpu/check.py``) resolve them exactly as
the engine does without importing the engine's tokenizer stack."""

from __future__ import annotations

import psutil
import torch

from superfluid.core.errors import ConfigError

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def resolve_device(spec: str, name: str) -> torch.device:
    """The torch device ``--device`` names (auto: CUDA, then MPS, then the CPU); a ConfigError
    naming it if it is not there."""
    spec = (spec or "auto").strip().lower()
    if spec == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    try:
        device = torch.device(spec)
    except (RuntimeError, ValueError):
        raise ConfigError(f"model {name!r}: device {spec!r} is not a torch device (cpu, cuda, cuda:N, mps)") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"model {name!r}: device {spec!r} is not available: this torch "
                              f"({torch.__version__}) sees no CUDA device")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ConfigError(f"model {name!r}: device {spec!r} is not available: "
                              f"{torch.cuda.device_count()} CUDA device(s)")
    elif device.type == "mps":
        if getattr(torch.backends, "mps", None) is None or not torch.backends.mps.is_available():
            raise ConfigError(f"model {name!r}: device {spec!r} is not available (no Apple MPS here)")
    elif device.type != "cpu":
        raise ConfigError(f"model {name!r}: device {spec!r} is not supported (cpu, cuda, cuda:N, mps)")
    return device


def resolve_decode(attention: str, graphs: str, device: torch.device, kv_bits: int, name: str) -> tuple[str, bool]:
    """(attention kernel, CUDA graphs on) from ``--attention`` and ``--cuda-graphs``: auto picks
    flex and graphs on CUDA with 16-bit KV (FlexAttention reads 16-bit pages only), sdpa
    elsewhere; an explicit choice the device or KV width cannot honour is a ConfigError."""
    if attention == "flex" and kv_bits:
        raise ConfigError(f"model {name!r}: attention flex reads 16-bit KV pages; with kv-bits {kv_bits} "
                          "use attention sdpa (or auto)")
    if graphs == "on" and device.type != "cuda":
        raise ConfigError(f"model {name!r}: cuda-graphs on needs a CUDA device, not {device}")
    if attention == "auto":
        attention = "flex" if device.type == "cuda" and not kv_bits else "sdpa"
    if graphs == "on" and attention != "flex":
        raise ConfigError(f"model {name!r}: cuda-graphs on replays the flex decode step; it needs attention "
                          f"flex (or auto with 16-bit KV), not {attention}")
    return attention, graphs == "on" or (graphs == "auto" and attention == "flex" and device.type == "cuda")


def resolve_dtype(spec: str, device: torch.device) -> torch.dtype:
    if (spec or "auto") == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[spec]


def free_memory(device: torch.device) -> int:
    """Bytes the KV pool may draw from: the device's free memory (CUDA), else the host's."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    return int(psutil.virtual_memory().available)
