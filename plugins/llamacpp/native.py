"""The C decode loop (``_rounds.c``) behind a small Python face, or None where it is not built.

The worker runs every step in Python when the extension is missing (a source checkout that was
never installed, or a build that had no C compiler): same tokens, about 1 % slower at one lane."""

from __future__ import annotations

import ctypes
import logging
from typing import NamedTuple

import llama_cpp
import numpy as np

from superfluid.core.stop_flag import StopFlag

log = logging.getLogger("superfluid.llamacpp")

# llama.h's llama_batch, as _rounds.c declares it
BATCH_LAYOUT = ["n_tokens", "token", "embd", "pos", "n_seq_id", "seq_id", "logits"]


class RoundsOutcome(NamedTuple):
    """What one call did: per lane the tokens it sampled and whether it ended (1 end of
    generation, 2 room used up); per round the lanes in it and its seconds; ``rc``, the non-zero
    code of a llama_decode that ended the call (that round is not counted)."""

    tokens: list[list[int]]
    ended: list[int]
    round_lanes: list[int]
    round_seconds: list[float]
    rc: int


class DecodeRounds:
    def __init__(self, lib: ctypes.CDLL, ctx, vocab, batch, n_vocab: int, stop_flag: StopFlag):
        self._fn = lib.sf_decode_rounds
        self._ctx = _address(ctx)
        self._vocab = _address(vocab)
        self._batch = ctypes.addressof(batch)
        self._n_vocab = n_vocab
        self._flags = stop_flag.address  # read before each round (stop and yield)

    def run(self, slots: list[int], pos: list[int], last: list[int], samplers: list, room: list[int],
            ignore_eos: list[bool], quiet: bool) -> RoundsOutcome:
        """Decode rounds for lanes in sequence order (see ``sf_decode_rounds``); ``samplers``
        holds a llama.cpp sampler chain per lane, or None for a greedy argmax."""
        n = len(slots)
        max_rounds = max(room)
        pos_a = np.array(pos, dtype=np.int32)
        last_a = np.array(last, dtype=np.int32)
        room_a = np.array(room, dtype=np.int32)
        ended = np.zeros(n, dtype=np.uint8)
        out = np.empty(n * max_rounds, dtype=np.int32)
        round_lanes = np.empty(max_rounds, dtype=np.int32)
        round_seconds = np.empty(max_rounds, dtype=np.float64)
        sampler_a = (ctypes.c_void_p * n)(*[_address(s) if s else None
                                            for s in samplers])
        rc = ctypes.c_int32(0)
        rounds = self._fn(self._ctx, self._vocab, self._batch, n, _ptr(np.array(slots, dtype=np.int32)),
                          _ptr(pos_a), _ptr(last_a), ctypes.addressof(sampler_a), _ptr(room_a),
                          _ptr(np.array(ignore_eos, dtype=np.uint8)), _ptr(ended), self._n_vocab,
                          self._flags, int(quiet), max_rounds, _ptr(out), _ptr(round_lanes),
                          _ptr(round_seconds), ctypes.addressof(rc))
        grid = out[:rounds * n].reshape(rounds, n)
        tokens = [[int(t) for t in grid[:, i] if t >= 0] for i in range(n)]
        return RoundsOutcome(tokens, ended.tolist(), round_lanes[:rounds].tolist(),
                             round_seconds[:rounds].tolist(), rc.value)


def _ptr(a: np.ndarray) -> int:
    return a.ctypes.data


def _address(obj) -> int:
    """The address a ctypes pointer or function holds."""
    return ctypes.cast(obj, ctypes.c_void_p).value


def load() -> ctypes.CDLL | None:
    """The built extension, bound to llama-cpp-python's functions; None if it is not built or
    llama-cpp-python's llama_batch is not the layout it was written for."""
    try:
        from . import _rounds
    except ImportError:
        log.info("llama.cpp decode loop in Python (the C extension superfluid.plugins.llamacpp._rounds "
                 "is not built)")
        return None
    layout = [name for name, _ in llama_cpp.llama_batch._fields_]
    if layout != BATCH_LAYOUT:
        log.warning("llama.cpp decode loop in Python: llama_batch is %s, not %s", layout, BATCH_LAYOUT)
        return None
    lib = ctypes.CDLL(_rounds.__file__)
    lib.sf_bind.restype = None
    lib.sf_bind.argtypes = [ctypes.c_void_p] * 4
    lib.sf_bind(_address(llama_cpp.llama_decode), _address(llama_cpp.llama_get_logits_ith),
                _address(llama_cpp.llama_sampler_sample), _address(llama_cpp.llama_vocab_is_eog))
    fn = lib.sf_decode_rounds
    fn.restype = ctypes.c_int32
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int32,
                   ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                   ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int32, ctypes.c_void_p, ctypes.c_int32,
                   ctypes.c_int32, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    return lib
