"""A ``llama_batch`` of embedding rows (image rows) whose positions may be several numbers a row.

``llama_batch_init`` sizes ``pos`` at one number a row, which is what a token batch and a 1-D
embedding batch take. Under M-RoPE (:mod:`.mrope`) llama.cpp reads ``n_pos_per_embd`` (4) numbers
a row from an embedding batch, *section-major over the whole batch*: ``pos[j * n_tokens + i]`` is
number ``j`` of row ``i`` (``llama_batch_compat::init`` in src/llama-batch.cpp). So when several
lanes' image rows share one ``llama_decode`` the sections interleave the lanes: all the time
positions first, then all the row positions, and so on, not lane after lane.

:class:`EmbeddingBatch` owns its arrays (numpy, nothing for ``llama_batch_free`` to free), takes
rows lane by lane with their ``n_pos × count`` positions, and lays the positions out
section-major when the batch is handed to ``llama_decode``.
"""

from __future__ import annotations

import ctypes

import numpy as np


class EmbeddingBatch:
    """Up to ``capacity`` embedding rows ``width`` floats wide, ``n_pos`` positions each (1 for
    ordinary positions, 4 under M-RoPE)."""

    def __init__(self, capacity: int, width: int, n_pos: int = 1):
        import llama_cpp

        self.capacity, self.width, self.n_pos = capacity, width, n_pos
        self.embd = np.zeros((capacity, width), dtype=np.float32)
        self._pos_rows = np.zeros((n_pos, capacity), dtype=np.int32)  # as added: section j of row i
        self._pos = np.zeros(n_pos * capacity, dtype=np.int32)        # as llama.cpp reads it
        self.n_seq_id = np.ones(capacity, dtype=np.int32)
        self._seq = np.zeros(capacity, dtype=np.int32)
        self.logits = np.zeros(capacity, dtype=np.int8)
        self._seq_ptrs = (ctypes.POINTER(ctypes.c_int32) * capacity)(
            *[ctypes.cast(self._seq.ctypes.data + 4 * i, ctypes.POINTER(ctypes.c_int32)) for i in range(capacity)])
        self._batch = llama_cpp.llama_batch()
        self._batch.token = None
        self._batch.embd = self.embd.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
        self._batch.pos = self._pos.ctypes.data_as(ctypes.POINTER(ctypes.c_int32))
        self._batch.n_seq_id = self.n_seq_id.ctypes.data_as(ctypes.POINTER(ctypes.c_int32))
        self._batch.seq_id = self._seq_ptrs
        self._batch.logits = self.logits.ctypes.data_as(ctypes.POINTER(ctypes.c_int8))
        self.n = 0

    @property
    def room(self) -> int:
        return self.capacity - self.n

    def clear(self) -> None:
        self.n = 0

    def add(self, rows: np.ndarray, positions: np.ndarray, seq: int, logits_last: bool = False) -> int:
        """Append ``rows`` (``count × width``) of sequence ``seq`` at ``positions``
        (``n_pos × count``, or ``count`` numbers when ``n_pos`` is 1); the batch index of the
        first. ``logits_last``: the last row's logits are wanted."""
        count = rows.shape[0]
        if count > self.room:
            raise ValueError(f"{count} rows do not fit: {self.room} of {self.capacity} left")
        positions = np.asarray(positions, dtype=np.int32).reshape(self.n_pos, count)
        first = self.n
        self.embd[first:first + count] = rows
        self._pos_rows[:, first:first + count] = positions
        self._seq[first:first + count] = seq
        self.logits[first:first + count] = 0
        if logits_last:
            self.logits[first + count - 1] = 1
        self.n += count
        return first

    def batch(self):
        """The ``llama_batch`` to decode: the rows added so far, positions section-major."""
        n = self.n
        self._pos[:self.n_pos * n] = self._pos_rows[:, :n].reshape(-1)
        self._batch.n_tokens = n
        return self._batch

    def positions(self) -> np.ndarray:
        """The positions as llama.cpp will read them (``n_pos * n`` numbers, section-major)."""
        self.batch()
        return self._pos[:self.n_pos * self.n].copy()
