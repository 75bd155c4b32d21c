"""Host memory the llama.cpp runner keeps outside llama.cpp: parked KV buffers, and numpy views
of llama.cpp's logits rows."""

from __future__ import annotations

import ctypes
import mmap

import llama_cpp
import numpy as np


def host_buffer(size: int) -> ctypes.Array:
    """Host memory for a parked sequence, from a fresh anonymous mapping (huge pages asked for).

    A ctypes array zero-fills itself, touching every page before llama.cpp writes the state
    into it: parking a 285-token SmolLM2 sequence (6.6 MB) took 18 ms that way against 6 ms
    from a mapping, where the kernel's zeroed pages arrive as llama.cpp writes. The array keeps
    the mapping alive; dropping the array unmaps it."""
    region = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            region.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # no transparent huge pages here: 4 KiB pages it is
            pass
    return (ctypes.c_uint8 * size).from_buffer(region)


# llama_get_logits_ith with the row's address as a plain int: llama-cpp-python's binding returns a
# float pointer, and casting that to an array costs several times the argmax it feeds.
_logits_row_address = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int32)(
    ctypes.cast(llama_cpp.llama_get_logits_ith, ctypes.c_void_p).value)


class LogitRows:
    """numpy views of logits rows, kept by address: llama.cpp writes every step's logits into
    the same output buffer, so after the first steps a row costs one call and a dict lookup."""

    MAX_VIEWS = 4096  # rows of a 512-output buffer, several times over

    def __init__(self, n_vocab: int):
        self.n_vocab = n_vocab
        self.views: dict[int, np.ndarray] = {}

    def row(self, ctx, index: int) -> np.ndarray:
        address = _logits_row_address(ctx, index)
        if not address:
            raise RuntimeError(f"llama.cpp has no logits for batch row {index}")
        view = self.views.get(address)
        if view is None:
            if len(self.views) >= self.MAX_VIEWS:  # the buffer moved many times: start over
                self.views.clear()
            view = self.views[address] = np.frombuffer(
                (ctypes.c_float * self.n_vocab).from_address(address), dtype=np.float32)
        return view
