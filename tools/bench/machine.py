"""Which machine a number came from: its CPU and the instruction sets that decide llama.cpp's
kernels (AVX2, AVX-512, AMX), so that a table can say what it was measured on. These machines
differ (AMD EPYC with AVX2 only, Intel Xeon with AVX-512 and AMX), and so do their numbers."""

from __future__ import annotations

import os
import platform

# the /proc/cpuinfo flags that change which of llama.cpp's CPU paths run
SIMD_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "avx_vnni", "amx_tile", "amx_int8", "amx_bf16",
              "asimd", "sve")


def describe() -> dict:
    """{"cpu": model name, "cores": logical CPUs, "flags": the SIMD flags present}."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name":
                    model = value.strip()
                elif key in ("flags", "Features") and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    return {"cpu": model, "cores": os.cpu_count(), "flags": [f for f in SIMD_FLAGS if f in flags]}


def line() -> str:
    """``Machine: AMD EPYC, 2 cores, avx2`` for a table's heading."""
    m = describe()
    return f"Machine: {m['cpu']}, {m['cores']} cores, {' '.join(m['flags']) or 'no SIMD flags read'}"
