"""llama-cpp-python's own ``Llama`` as the reference for a narrow KV cache (``type_k``/``type_v``)
and for rope scaling (the YaRN context params). Run them through
``tests.llama_reference.in_child`` (a native crash fails one test, not the run)."""

from __future__ import annotations

KV_TYPES = {0: 1, 8: 8, 4: 2}  # --kv-bits → ggml_type: F16, Q8_0, Q4_0


def greedy_at_kv_bits(path: str, prompts: list[str], max_tokens: int, kv_bits: int, n_ctx: int = 2048) -> dict:
    """Each prompt completed alone at temperature 0 with K and V at ``kv_bits``' type and flash
    attention on (as the server's context has it): {prompt: (text, completion tokens)}."""
    from superfluid.plugins.llamacpp.extra_buffers import reference_llama

    kv = KV_TYPES[kv_bits]
    llm = reference_llama(path, n_ctx=n_ctx, flash_attn=True, type_k=kv, type_v=kv, verbose=False, seed=0,
                          n_threads=2)
    try:
        refs = {}
        for p in prompts:
            out = llm.create_completion(p, max_tokens=max_tokens, temperature=0.0, repeat_penalty=1.0)
            refs[p] = (out["choices"][0]["text"], out["usage"]["completion_tokens"])
        return refs
    finally:
        llm.close()


def tokenize(path: str, text: str) -> list[int]:
    """``text`` as the model's tokens (with BOS), from the vocabulary alone."""
    import llama_cpp

    llm = llama_cpp.Llama(path, vocab_only=True, verbose=False)
    try:
        return llm.tokenize(text.encode(), add_bos=True)
    finally:
        llm.close()


def token_logprobs(path: str, tokens: list[int], start: int, count: int, n_ctx: int, **rope) -> list[float]:
    """The log-probability of ``tokens[j]`` given the tokens before it, for ``start <= j <
    start + count``, from a ``Llama`` with ``rope`` (rope_scaling_type, rope_freq_scale,
    yarn_orig_ctx, ...) and flash attention on. The prefix is fed in 512-token batches without
    logits, then the scored positions in one batch from the last 512 boundary, with logits, as
    the server's prefill chunks feed a prompt (a one-token decode multiplies through another
    kernel and rounds differently), so only ``count`` rows of logits are ever held."""
    import llama_cpp
    import numpy as np

    from superfluid.plugins.llamacpp.extra_buffers import reference_llama

    def logprob(row, token: int) -> float:
        logits = np.ctypeslib.as_array(row, shape=(llm.n_vocab(),)).astype(np.float64)
        top = logits.max()
        return float(logits[token] - top - np.log(np.exp(logits - top).sum()))

    llm = reference_llama(path, n_ctx=n_ctx, flash_attn=True, verbose=False, n_threads=2, n_batch=512, **rope)
    first = start - start % 512  # the last batch starts where a 512-token prefill chunk would
    fed = tokens[first:start + count - 1]
    batch = llama_cpp.llama_batch_init(len(fed), 0, 1)
    try:
        llm.eval(tokens[:first])
        for i, token in enumerate(fed):  # logits for the rows that score tokens[start:start + count]
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, first + i, 1
            batch.logits[i] = first + i >= start - 1
            batch.seq_id[i][0] = 0
        batch.n_tokens = len(fed)
        if llama_cpp.llama_decode(llm.ctx, batch) != 0:
            raise RuntimeError("llama_decode failed on the scored positions")
        return [logprob(llama_cpp.llama_get_logits_ith(llm.ctx, j - 1 - first), tokens[j])
                for j in range(start, start + count)]
    finally:
        llama_cpp.llama_batch_free(batch)
        llm.close()
