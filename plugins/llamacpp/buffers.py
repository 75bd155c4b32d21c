"""Host memory the llama.cpp runner keeps outside llama.cpp: parked KV buffers, and numpy views
of llama.cpp's logits rows."""

from __future__ import annotations

import ctypes
import mmap
import threading
import weakref

import llama_cpp
import numpy as np


SPARE_BYTES = 256 << 20  # mappings of dropped buffers kept for the next park, at most this much
_spare: list[mmap.mmap] = []
_spare_lock = threading.Lock()  # buffers die on the writer thread too


def host_buffer(size: int) -> ctypes.Array:
    """Host memory for a parked sequence: a mapping a dropped buffer left, else a fresh one (huge
    pages asked for).

    A ctypes array zero-fills itself, touching every page before llama.cpp writes the state
    into it: parking a 285-token SmolLM2 sequence (6.6 MB) took 18 ms that way against 6 ms
    from a mapping, where the kernel's zeroed pages arrive as llama.cpp writes. A fresh mapping
    still costs its page faults: a session's seal parks its whole KV (46 MB at 2,000 tokens) and
    drops it once written, and on a 2-core AMD EPYC, with the artifacts filling the page cache,
    half of those copies took 65-140 ms against 10-20 ms into pages already mapped (a 46 MB
    copy: 135-140 ms into a fresh mapping, 5-6 ms into a used one). So when a buffer's last user
    drops it (the runner, or the writer thread that writes it to its artifact), its mapping
    waits here, up to SPARE_BYTES, for the next park of a size it fits.

    A spare's pages are marked free (MADV_FREE) as it waits: they leave the working set that the
    pressure ladder and a memory cgroup read, and the kernel takes them back under pressure
    without a swap, so a dropped host tier frees its memory though its mappings stay. Pages the
    kernel has not taken yet are written again without a fault (a 46 MB copy: 4 ms, as into a
    used mapping); any it took come back zeroed, as a fresh mapping's."""
    region = _take_spare(size)
    if region is None:
        region = mmap.mmap(-1, _rounded(size), flags=mmap.MAP_PRIVATE)
        if hasattr(mmap, "MADV_HUGEPAGE"):
            try:
                region.madvise(mmap.MADV_HUGEPAGE)
            except OSError:  # no transparent huge pages here: 4 KiB pages it is
                pass
    buf = (ctypes.c_uint8 * size).from_buffer(region)
    weakref.finalize(buf, _give_back, region)
    return buf


def _rounded(size: int) -> int:
    """Mappings in whole huge pages (2 MiB), so a later sequence a little longer fits a spare."""
    return -(-size // (2 << 20)) * (2 << 20)


def _take_spare(size: int) -> mmap.mmap | None:
    """The smallest spare mapping that holds ``size`` bytes without wasting half of itself."""
    with _spare_lock:
        fits = [r for r in _spare if size <= len(r) <= 2 * _rounded(size)]
        if not fits:
            return None
        region = min(fits, key=len)
        _spare.remove(region)
        return region


def _give_back(region: mmap.mmap) -> None:
    if hasattr(mmap, "MADV_FREE"):
        try:
            region.madvise(mmap.MADV_FREE)
        except OSError:  # a kernel without it: the pages stay in the working set while spare
            pass
    with _spare_lock:
        _spare.append(region)
        while sum(len(r) for r in _spare) > SPARE_BYTES:
            _spare.pop(0).close()  # the oldest goes back to the OS


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
