"""The worker's warm-up decode, run before it reports ready.

A runtime fault that hits every batched decode (llama.cpp's AMX path, #20824) would otherwise
meet the first user request, and each restart would die on the next one: a crash loop that the
daemon can only give up on. Running the shape that faulted before "ready" (two sequences of
several tokens in one batch, then one token each) moves the fault to start-up, where the daemon
can start the worker again with safe settings (``LlamaCppEngine.start``). It costs two tiny
decodes, and the KV is cleared afterwards.

``SUPERFLUID_TEST_WARMUP_CRASH`` is a test-only switch that makes the warm-up die with SIGSEGV:
``extra-buffers`` only while the extra buffer types are on, ``always`` whatever they are.
"""

from __future__ import annotations

import os
import signal

import llama_cpp

CRASH_ENV = "SUPERFLUID_TEST_WARMUP_CRASH"
SEQUENCES = 2
PREFILL_TOKENS = 3


class WarmupFailed(RuntimeError):
    """llama_decode refused the warm-up batch (it returned non-zero)."""


def injected_crash(extra_buffers: bool) -> None:
    """Die with SIGSEGV here when the test-only switch asks for it."""
    wanted = os.environ.get(CRASH_ENV, "")
    if wanted == "always" or (wanted == "extra-buffers" and extra_buffers):
        os.kill(os.getpid(), signal.SIGSEGV)


def _decode(ctx, batch, rows: list[tuple[int, int, int]]) -> None:
    """Decode ``rows`` of (sequence, position, token), asking logits for each sequence's last."""
    last = {seq: pos for seq, pos, _ in rows}
    batch.n_tokens = len(rows)
    for i, (seq, pos, token) in enumerate(rows):
        batch.token[i] = token
        batch.pos[i] = pos
        batch.n_seq_id[i] = 1
        batch.seq_id[i][0] = seq
        batch.logits[i] = pos == last[seq]
    status = llama_cpp.llama_decode(ctx, batch)
    if status != 0:
        raise WarmupFailed(f"the warm-up decode failed (llama_decode returned {status})")


def warm_up(ctx, vocab, extra_buffers: bool) -> None:
    """Prefill ``SEQUENCES`` sequences of ``PREFILL_TOKENS`` tokens in one batch, decode one token
    for each, then clear the KV."""
    injected_crash(extra_buffers)
    token = llama_cpp.llama_vocab_bos(vocab)
    if token < 0:
        token = 0
    batch = llama_cpp.llama_batch_init(SEQUENCES * PREFILL_TOKENS, 0, 1)
    try:
        _decode(ctx, batch, [(seq, pos, token) for seq in range(SEQUENCES) for pos in range(PREFILL_TOKENS)])
        _decode(ctx, batch, [(seq, PREFILL_TOKENS, token) for seq in range(SEQUENCES)])
    finally:
        llama_cpp.llama_batch_free(batch)
        llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(ctx), True)
