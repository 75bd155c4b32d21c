"""The memory llama.cpp's weights leave free on the device that holds them (measured after the
model is loaded), for the shared pool's 60 % cap.

llama-cpp-python binds none of ggml's device API, so :func:`ggml_devices` calls the C functions
of the ggml library it loaded (``ggml_backend_dev_count``, ``_get``, ``_name``, ``_type``,
``_memory``) through ctypes. With layers offloaded (``n_gpu_layers`` not 0, llama.cpp's default
is all of them) to GPU devices, the KV goes with its layers (``offload_kqv``), so the figure is the
GPUs' free memory. On the CPU it is the host's available memory less the weights held in a file
mapping (:func:`superfluid.plugins.kvpool.layout.host_free`): ggml's CPU device reports all of
the machine's memory as free, which says nothing. Where the ggml library or its device API
cannot be found, the host's figure is used, and the reason is logged in ``how``.
"""

from __future__ import annotations

import ctypes
import glob
import os

import attrs

from superfluid.plugins.kvpool.layout import FreeMemory, host_free

DEVICE_TYPES = {0: "CPU", 1: "GPU", 2: "IGPU", 3: "ACCEL", 4: "META"}  # enum ggml_backend_dev_type
GPU_TYPES = ("GPU", "IGPU")


@attrs.frozen
class Device:
    name: str
    kind: str
    free: int
    total: int


def _ggml_library():
    import llama_cpp

    lib_dir = os.path.join(os.path.dirname(llama_cpp.__file__), "lib")
    for pattern in ("libggml.so*", "libggml.dylib", "ggml.dll", "libggml-base.*"):
        for path in sorted(glob.glob(os.path.join(lib_dir, pattern))):
            try:
                lib = ctypes.CDLL(path)
                lib.ggml_backend_dev_count  # noqa: B018  raises AttributeError where absent
                return lib
            except (OSError, AttributeError):
                continue
    return None


def ggml_devices() -> list[Device] | None:
    """ggml's devices with their free and total memory (None: the device API is not reachable)."""
    lib = _ggml_library()
    if lib is None:
        return None
    lib.ggml_backend_dev_count.restype = ctypes.c_size_t
    lib.ggml_backend_dev_get.restype = ctypes.c_void_p
    lib.ggml_backend_dev_get.argtypes = [ctypes.c_size_t]
    lib.ggml_backend_dev_name.restype = ctypes.c_char_p
    lib.ggml_backend_dev_name.argtypes = [ctypes.c_void_p]
    lib.ggml_backend_dev_type.restype = ctypes.c_int
    lib.ggml_backend_dev_type.argtypes = [ctypes.c_void_p]
    lib.ggml_backend_dev_memory.restype = None
    lib.ggml_backend_dev_memory.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t),
                                            ctypes.POINTER(ctypes.c_size_t)]
    devices = []
    for i in range(lib.ggml_backend_dev_count()):
        dev = lib.ggml_backend_dev_get(i)
        free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
        lib.ggml_backend_dev_memory(dev, ctypes.byref(free), ctypes.byref(total))
        name = (lib.ggml_backend_dev_name(dev) or b"?").decode(errors="replace")
        devices.append(Device(name, DEVICE_TYPES.get(lib.ggml_backend_dev_type(dev), "?"), free.value, total.value))
    return devices


def weights_free(n_gpu_layers: int, mapped_weight_bytes: int, devices: list[Device] | None) -> FreeMemory:
    """Free memory where the weights sit: the GPUs' when layers are offloaded to any, else the host's."""
    gpus = [d for d in devices or () if d.kind in GPU_TYPES]
    if gpus and n_gpu_layers != 0:
        return FreeMemory(sum(d.free for d in gpus), "+".join(d.name for d in gpus),
                          "ggml_backend_dev_memory after loading")
    memory = host_free(mapped_weight_bytes)
    if devices is None:
        return attrs.evolve(memory, how=memory.how + " (ggml's device API not reachable)")
    return memory
